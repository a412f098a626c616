"""The emulated engine's own span per inference request, as vLLM's ``--otlp-traces-endpoint``.

vLLM exports one ``llm_request`` span per request, a child of the request's W3C
``traceparent``; the emulator does the same when its :class:`EngineSpec` has a
``tracer_provider`` (tests: the SDK's in-memory exporter) or ``fastroute engine`` is given
``--otlp-traces-endpoint``. Behind fastroute the parent is the proxy's ``fastroute.attempt``
span, so router and engine spans share one trace id. Without a provider nothing is added
to the app (no middleware), and OpenTelemetry is not imported.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

__all__ = ["ENGINE_SPAN_NAME", "engine_span_middleware", "otlp_tracer_provider"]

#: vLLM's name for its per-request span.
ENGINE_SPAN_NAME = "llm_request"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def otlp_tracer_provider(endpoint: str, service_name: str) -> Any:
    """A tracer provider that batches spans to the OTLP/HTTP traces URL ``endpoint``.

    Raises
    ------
    RuntimeError
        The OpenTelemetry SDK or its OTLP/HTTP exporter is not installed.
    """
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:  # pragma: no cover - the test extra installs it
        raise RuntimeError(
            "--otlp-traces-endpoint needs the OpenTelemetry SDK: pip install 'fastroute[tracing]'"
        ) from exc
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


def engine_span_middleware(provider: Any, engine: str, model: str) -> Any:
    """An aiohttp middleware: one ``llm_request`` span per ``POST /v1/...`` request.

    Parameters
    ----------
    provider : TracerProvider
        Where the spans go.
    engine, model : str
        The engine's name and served model (span attributes).
    """
    from opentelemetry.trace import SpanKind, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    tracer = provider.get_tracer("fastroute.emulator")
    propagator = TraceContextTextMapPropagator()

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method != "POST" or not request.path.startswith("/v1/"):
            return await handler(request)
        span = tracer.start_span(
            ENGINE_SPAN_NAME,
            context=propagator.extract(request.headers),
            kind=SpanKind.SERVER,
            attributes={
                "gen_ai.response.model": model,
                "gen_ai.request.id": request.headers.get("x-request-id", ""),
                "url.path": request.path,
                "fastroute.engine": engine,
            },
        )
        try:
            # A stream is written inside the handler: the span ends with its last event.
            response = await handler(request)
        except BaseException as exc:
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            span.end()
            raise
        span.set_attribute("http.response.status_code", response.status)
        if response.status >= 500:
            span.set_status(Status(StatusCode.ERROR, f"HTTP {response.status}"))
        span.end()
        return response

    return middleware
