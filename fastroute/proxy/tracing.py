"""OpenTelemetry traces of the request path (``[tracing]``, docs/operations.md "Tracing").

Off by default. The request path holds :data:`NO_TRACING` then: its ``enabled`` is False,
the handler checks it once per request and creates nothing (no span, no context, and
OpenTelemetry is not even imported). On, :meth:`Tracing.begin` makes one
:class:`RequestTrace` per request (``RequestState.trace``), and the steps call it:

* ``fastroute.request`` (SERVER): the request; a child of the client's W3C
  ``traceparent``/``tracestate`` when it sent them. Model, class, priority, tenant, TTFT,
  prompt and output tokens and the HTTP status are its attributes.
* ``fastroute.classify``, ``fastroute.admission``, ``fastroute.pick`` (candidates, chosen
  engine, reason): its children.
* ``fastroute.attempt`` (CLIENT): one per attempt (engine, rank, status, outcome, retry
  reason); its context goes to the engine as ``traceparent``, so the engine's own spans
  (vLLM's ``--otlp-traces-endpoint``, the emulator's) are its children.
* ``fastroute.migration``: one per continuation of a migrated stream; the continuation's
  attempt is its child.

Contexts are passed explicitly (never attached to the ``contextvars`` context): the
path's coroutines interleave on one loop, and nothing else in the proxy reads the
current span. Spans go through a ``BatchSpanProcessor`` (a bounded queue,
``tracing.max_queue_size``; full, new spans are dropped) whose exporter runs on its own
thread: the event loop never waits for an export.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from fastroute.config import TracingConfig

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span

    from fastroute.policy import Decision
    from fastroute.proxy.path.decisions import Attempt
    from fastroute.proxy.path.fleet import Fleet
    from fastroute.proxy.path.request_state import RequestState

_log = logging.getLogger(__name__)

__all__ = ["NO_TRACING", "NoTracing", "RequestTrace", "Tracing", "UnsampledTrace", "build_tracing"]

_TRACE_HEADERS = (b"traceparent:", b"tracestate:")


class NoTracing:
    """The tracer of a proxy with tracing off: the request path only reads ``enabled``."""

    enabled = False

    def force_flush(self) -> bool:
        """Nothing to flush."""
        return True

    def shutdown(self) -> None:
        """Nothing to stop."""


#: The tracer of every context whose config has ``tracing.enabled = false``.
NO_TRACING = NoTracing()


def build_tracing(config: TracingConfig, exporter: SpanExporter | None = None) -> Any:
    """The request path's tracer for ``config``: :data:`NO_TRACING` when it is off.

    Parameters
    ----------
    config : TracingConfig
    exporter : SpanExporter, optional
        Where spans go instead of ``otlp_endpoint`` (tests: the SDK's
        ``InMemorySpanExporter``).

    Raises
    ------
    RuntimeError
        Tracing is on and the OpenTelemetry SDK is not installed (``fastroute[tracing]``).
    """
    if not config.enabled:
        return NO_TRACING
    return Tracing(config, exporter)


class Tracing:
    """The tracer provider, sampler and exporter of one proxy process (tracing on).

    Parameters
    ----------
    config : TracingConfig
    exporter : SpanExporter, optional
        Overrides ``config.otlp_endpoint``.
    """

    enabled = True

    def __init__(self, config: TracingConfig, exporter: SpanExporter | None = None) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError as exc:  # pragma: no cover - the test extra installs it
            raise RuntimeError(
                "tracing.enabled needs the OpenTelemetry SDK: pip install 'fastroute[tracing]'"
            ) from exc
        self.config = config
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": config.service_name}),
            sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
        )
        if exporter is None and config.otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(
                endpoint=config.otlp_endpoint, timeout=config.export_timeout_s
            )
        if exporter is None:
            _log.warning("tracing.enabled without tracing.otlp_endpoint: spans go nowhere")
        else:
            self.provider.add_span_processor(
                BatchSpanProcessor(
                    exporter,
                    max_queue_size=config.max_queue_size,
                    schedule_delay_millis=config.schedule_delay_s * 1000.0,
                    max_export_batch_size=config.max_export_batch_size,
                    export_timeout_millis=config.export_timeout_s * 1000.0,
                )
            )
        self.tracer = self.provider.get_tracer("fastroute.proxy")
        self.propagator = TraceContextTextMapPropagator()

    def begin(self, state: RequestState) -> RequestTrace:
        """The trace of a request just arrived: its ``fastroute.request`` span, a child of
        the client's ``traceparent`` when it sent one."""
        from opentelemetry.trace import SpanKind

        parent = self.propagator.extract(state.request.headers)
        span = self.tracer.start_span(
            "fastroute.request",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "fastroute.request_id": state.record.request_id,
                "url.path": state.request.path,
                "fastroute.endpoint": state.kind,
            },
        )
        if not span.is_recording():  # not sampled: only the flag travels on to the engine
            return UnsampledTrace(self, span)
        return RequestTrace(self, span)

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        """Export every span ended so far (tests, shutdown)."""
        return self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Flush and stop the exporter thread."""
        self.provider.shutdown()


class RequestTrace:
    """The spans of one request (``RequestState.trace``); every step calls it.

    Parameters
    ----------
    tracing : Tracing
    span : Span
        The request's ``fastroute.request`` span.
    """

    __slots__ = ("tracing", "span", "context", "parent", "prompt_tokens")

    def __init__(self, tracing: Tracing, span: Span) -> None:
        from opentelemetry.trace import set_span_in_context

        self.tracing = tracing
        self.span = span
        self.context = set_span_in_context(span)
        #: Where attempt spans go: the request's context, or a migration segment's.
        self.parent = self.context
        #: The engine's reported ``usage.prompt_tokens`` (None: not reported).
        self.prompt_tokens: int | None = None

    @staticmethod
    def now_ns() -> int:
        """The clock spans are timed with (wall clock, nanoseconds)."""
        return time.time_ns()

    def _child(self, name: str, start_ns: int, parent: Any = None, kind: Any = None) -> Span:
        from opentelemetry.trace import SpanKind

        return self.tracing.tracer.start_span(
            name,
            context=self.context if parent is None else parent,
            kind=SpanKind.INTERNAL if kind is None else kind,
            start_time=start_ns,
        )

    def _error(self, span: Span, description: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, description))

    def step(self, name: str, start_ns: int, error: str | None = None) -> None:
        """A finished step (``classify``, ``admission``) that began at ``start_ns``;
        ``error``: why it rejected the request."""
        span = self._child(f"fastroute.{name}", start_ns)
        if error is not None:
            span.set_attribute("fastroute.rejected", error)
            self._error(span, error)
        span.end()

    def picked(
        self, start_ns: int, fleet: Fleet, decision: Decision, mask: Any, stage: str | None
    ) -> None:
        """The pick over ``fleet`` (engines ``mask`` eligible) that began at ``start_ns``:
        candidates, chosen engine, reason; ``stage``: the P/D stage it is for."""
        span = self._child("fastroute.pick", start_ns)
        chosen = fleet.engines[decision.ranked[0]].name if decision.ranked else "none"
        span.set_attributes(
            {
                "fastroute.pick.candidates": int(mask.sum()),
                "fastroute.pick.ranked": len(decision.ranked),
                "fastroute.pick.engine": chosen,
                "fastroute.pick.policy": decision.policy,
                "fastroute.pick.reason": decision.reason,
            }
        )
        if stage is not None:
            span.set_attribute("fastroute.stage", stage)
        span.end()

    def attempt_started(self, attempt: Attempt) -> Span:
        """The span of an attempt about to be sent (a child of the request, or of the
        migration segment under way)."""
        from opentelemetry.trace import SpanKind

        span = self._child("fastroute.attempt", time.time_ns(), self.parent, SpanKind.CLIENT)
        span.set_attribute("fastroute.engine", attempt.engine)
        span.set_attribute("fastroute.attempt.rank", attempt.rank)
        if attempt.stage is not None:
            span.set_attribute("fastroute.stage", attempt.stage)
        return span

    def engine_headers(self, lines: bytes, span: Span) -> bytes:
        """``lines`` (the encoded header lines for the engine) with the attempt's own
        ``traceparent``/``tracestate`` instead of the client's."""
        from opentelemetry.trace import set_span_in_context

        if b"trace" in lines:  # drop the client's: the engine's parent is the attempt
            kept = [
                line
                for line in lines.split(b"\r\n")
                if line and not line.lower().startswith(_TRACE_HEADERS)
            ]
            lines = b"".join(line + b"\r\n" for line in kept)
        carrier: dict[str, str] = {}
        self.tracing.propagator.inject(carrier, context=set_span_in_context(span))
        extra = "".join(f"{name}: {value}\r\n" for name, value in carrier.items())
        return lines + extra.encode("latin-1")

    def attempt_finished(self, span: Span, attempt: Attempt) -> None:
        """End an attempt's span: its status, outcome and, when it failed, why (the
        reason it was retried or migrated)."""
        span.set_attribute("fastroute.attempt.outcome", attempt.outcome)
        if attempt.status is not None:
            span.set_attribute("http.response.status_code", attempt.status)
        if attempt.output_tokens is not None:
            span.set_attribute("gen_ai.usage.output_tokens", attempt.output_tokens)
        if attempt.outcome not in ("success", "pending"):
            reason = attempt.detail or attempt.outcome
            span.set_attribute("fastroute.attempt.retry_reason", reason)
            self._error(span, reason)
        span.end()

    def segment_started(self, count: int, engine: str, tokens_sent: int) -> Span:
        """The span of migration ``count`` (1 for the first continuation) onto ``engine``;
        the continuation's attempt becomes its child."""
        from opentelemetry.trace import set_span_in_context

        span = self._child("fastroute.migration", time.time_ns())
        span.set_attributes(
            {
                "fastroute.migration.count": count,
                "fastroute.engine": engine,
                "fastroute.migration.tokens_sent": tokens_sent,
            }
        )
        self.parent = set_span_in_context(span)
        return span

    def segment_finished(self, span: Span, outcome: str) -> None:
        """End a migration segment's span with its attempt's ``outcome``."""
        span.set_attribute("fastroute.migration.outcome", outcome)
        if outcome != "success":
            self._error(span, outcome)
        span.end()
        self.parent = self.context

    def finish(self, state: RequestState, status: int) -> None:
        """End the request span: the request's attributes, status and error."""
        record, span = state.record, self.span
        attributes: dict[str, Any] = {
            "http.response.status_code": status,
            "gen_ai.request.model": state.model or record.model,
            "fastroute.class": record.class_name,
            "fastroute.priority": state.priority,
            "fastroute.tenant": state.tenant,
            "fastroute.attempts": len(record.attempts),
        }
        ttft_s = record.timings.get("first_token")
        if ttft_s is not None:
            attributes["fastroute.ttft_s"] = ttft_s
        if record.attempts:
            attributes["fastroute.engine"] = record.attempts[-1].engine
        output = [a.output_tokens for a in record.attempts if a.output_tokens is not None]
        if output:
            attributes["gen_ai.usage.output_tokens"] = sum(output)
        if self.prompt_tokens is not None:
            attributes["gen_ai.usage.input_tokens"] = self.prompt_tokens
        elif state.route is not None:  # not reported by the engine: the router's estimate
            attributes["fastroute.prompt_tokens_estimate"] = state.route.prompt_tokens
        span.set_attributes(attributes)
        if record.error is not None and (status >= 500 or status == 499 or status < 400):
            self._error(span, record.error)  # 4xx are the client's: not the span's error
        elif status >= 500:
            self._error(span, f"HTTP {status}")
        span.end()


class UnsampledTrace(RequestTrace):
    """The trace of a request the sampler left out: no child span is made (each would be
    a non-recording one, about as costly to make as a real one); the engine still gets
    the request's context, whose flag tells it not to sample either."""

    __slots__ = ()

    def step(self, name: str, start_ns: int, error: str | None = None) -> None:
        """Not sampled: nothing."""

    def picked(
        self, start_ns: int, fleet: Fleet, decision: Decision, mask: Any, stage: str | None
    ) -> None:
        """Not sampled: nothing."""

    def attempt_started(self, attempt: Attempt) -> Span:
        """The request's own (non-recording) span: its context goes to the engine."""
        return self.span

    def attempt_finished(self, span: Span, attempt: Attempt) -> None:
        """Not sampled: nothing."""

    def segment_started(self, count: int, engine: str, tokens_sent: int) -> Span:
        """The request's own (non-recording) span."""
        return self.span

    def segment_finished(self, span: Span, outcome: str) -> None:
        """Not sampled: nothing."""

    def finish(self, state: RequestState, status: int) -> None:
        """Not sampled: nothing (ending a non-recording span records nothing)."""
