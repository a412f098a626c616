"""OpenTelemetry traces across the proxy and the (emulated) engines.

Real emulated engines and the real proxy on loopback; the proxy's spans and the engines'
``llm_request`` spans go to the SDK's ``InMemorySpanExporter`` (one each, so which
process made a span is never in doubt), and one test exports over OTLP/HTTP to a small
receiver that decodes the protobuf request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import openai
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from proxy_harness import MODEL, SHORT_OUTPUTS, config_toml, run

from fastroute.config import decode_config
from fastroute.emulator.server import EmulatedFleet, EngineSpec, fleet_specs
from fastroute.emulator.tracing import ENGINE_SPAN_NAME
from fastroute.hashing import key_hash
from fastroute.proxy.proxy_app import ProxyApp
from fastroute.proxy.tracing import NO_TRACING
from fastroute.testing.otlp import serve_otlp_receiver
from fastroute.testing.servers import serve_proxy_app

pytestmark = pytest.mark.integration

MAX_TOKENS = 6
PROXY_STEPS = ("fastroute.classify", "fastroute.admission", "fastroute.pick")
CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


@dataclass
class Traced:
    """A running traced stack: engines, proxy, and where each one's spans went."""

    fleet: EmulatedFleet
    app: ProxyApp
    url: str
    proxy_spans: InMemorySpanExporter
    engine_spans: InMemorySpanExporter

    def flush(self) -> tuple[list[ReadableSpan], list[ReadableSpan]]:
        """(proxy spans, engine spans) ended so far."""
        tracer = self.app.context.tracer
        assert tracer.force_flush()
        return list(self.proxy_spans.get_finished_spans()), list(
            self.engine_spans.get_finished_spans()
        )


@contextlib.asynccontextmanager
async def traced_stack(
    tracing: str, n_engines: int = 2, roles: tuple[str, ...] | None = None
) -> AsyncIterator[Traced]:
    """Engines that trace into one in-memory exporter, a proxy with ``tracing`` (the body
    of its ``[tracing]`` table) into another; ``roles``: a P/D fleet, one engine per role."""
    engine_spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(engine_spans))
    names = None
    if roles is None:
        specs = fleet_specs(
            n_engines,
            model_name=MODEL,
            profile="h100",
            output_lengths=SHORT_OUTPUTS,
            tracer_provider=provider,
        )
    else:
        names = [f"{role}-{i}" for i, role in enumerate(roles)]
        specs = [
            EngineSpec(name=name, model_name=MODEL, profile="h100", role=role, seed=i,
                       output_lengths=SHORT_OUTPUTS, tracer_provider=provider)
            for i, (name, role) in enumerate(zip(names, roles, strict=True))
        ]  # fmt: skip
    proxy_spans = InMemorySpanExporter()
    async with EmulatedFleet(specs) as fleet:
        extra = f"\n[tracing]\n{tracing}\n"
        toml = config_toml(fleet.urls, extra, names=names, roles=roles)
        config = decode_config(toml, source="tracing.toml")
        app = ProxyApp(config, span_exporter=proxy_spans)
        async with serve_proxy_app(app) as (url, _):
            yield Traced(fleet, app, url, proxy_spans, engine_spans)
    provider.shutdown()


def stream_chat(url: str, **extra_headers: str) -> tuple[str, int]:
    """One streamed chat completion with the official client: (text, chunks)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=15.0)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "trace me"}],
        max_tokens=MAX_TOKENS,
        stream=True,
        extra_body={"ignore_eos": True},
        extra_headers=extra_headers or None,
    )
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    return "".join(parts), len(parts)


def by_name(spans: list[ReadableSpan]) -> dict[str, list[ReadableSpan]]:
    out: dict[str, list[ReadableSpan]] = {}
    for span in spans:
        out.setdefault(span.name, []).append(span)
    return out


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def test_streamed_request_is_one_trace_across_router_and_engine() -> None:
    """Request span at the root; classify, admission, pick and the attempt its children;
    the engine's span the attempt's child; all under one trace id, with the attributes."""

    async def main() -> None:
        async with traced_stack("enabled = true") as st:
            text, chunks = await asyncio.to_thread(stream_chat, st.url)
            assert text and chunks >= MAX_TOKENS
            proxy, engine = st.flush()
        names = by_name(proxy)
        assert sorted(names) == sorted(("fastroute.request", "fastroute.attempt", *PROXY_STEPS))
        assert all(len(v) == 1 for v in names.values()), names
        (request,) = names["fastroute.request"]
        (attempt,) = names["fastroute.attempt"]
        (llm,) = engine
        assert llm.name == ENGINE_SPAN_NAME
        trace_id = request.context.trace_id
        assert {s.context.trace_id for s in [*proxy, llm]} == {trace_id}
        assert request.parent is None
        for span in [*(names[n][0] for n in PROXY_STEPS), attempt]:
            assert parent_id(span) == request.context.span_id, span.name
        assert parent_id(llm) == attempt.context.span_id
        (pick,) = names["fastroute.pick"]
        engine_name = pick.attributes["fastroute.pick.engine"]
        assert pick.attributes["fastroute.pick.candidates"] == 2
        assert pick.attributes["fastroute.pick.reason"]
        assert attempt.attributes["fastroute.engine"] == engine_name
        assert llm.attributes["fastroute.engine"] == engine_name
        assert attempt.attributes["http.response.status_code"] == 200
        assert attempt.attributes["fastroute.attempt.outcome"] == "success"
        attrs = request.attributes
        assert attrs["gen_ai.request.model"] == MODEL
        assert attrs["fastroute.class"] and attrs["fastroute.priority"] == "default"
        assert attrs["gen_ai.usage.output_tokens"] == MAX_TOKENS
        assert attrs["gen_ai.usage.input_tokens"] > 0
        assert 0 < attrs["fastroute.ttft_s"] < 5
        assert attrs["http.response.status_code"] == 200
        assert llm.attributes["gen_ai.request.id"] == attrs["fastroute.request_id"]
        # The engine's span lies inside the attempt's, the attempt inside the request's.
        assert request.start_time <= attempt.start_time <= llm.start_time
        assert llm.end_time <= attempt.end_time <= request.end_time

    run(main())


def test_client_traceparent_is_the_request_span_parent() -> None:
    """A client's ``traceparent``: the proxy's request span is its child, and the engine
    gets the attempt's context, not the client's."""

    async def main() -> None:
        traceparent = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
        async with traced_stack("enabled = true\nsample_ratio = 0.5") as st:
            await asyncio.to_thread(
                stream_chat, st.url, traceparent=traceparent, tracestate="vendor=1"
            )
            proxy, engine = st.flush()
        (request,) = by_name(proxy)["fastroute.request"]
        (attempt,) = by_name(proxy)["fastroute.attempt"]
        assert f"{request.context.trace_id:032x}" == CLIENT_TRACE_ID
        assert f"{parent_id(request):016x}" == CLIENT_SPAN_ID
        assert request.parent is not None and request.parent.is_remote
        (llm,) = engine
        assert llm.context.trace_id == request.context.trace_id
        assert parent_id(llm) == attempt.context.span_id
        assert llm.parent is not None and llm.parent.trace_state.to_header() == "vendor=1"

    run(main())


def test_sample_ratio_zero_makes_no_spans() -> None:
    """Sampling 0: no span is exported, and the engine (parent-based) follows the proxy's
    not-sampled flag."""

    async def main() -> None:
        async with traced_stack("enabled = true\nsample_ratio = 0.0") as st:
            for _ in range(3):
                await asyncio.to_thread(stream_chat, st.url)
            proxy, engine = st.flush()
        assert proxy == [] and engine == []

    run(main())


def test_tracing_off_makes_no_span_and_relays_the_clients_context() -> None:
    """Off (the default): the tracer is the no-op, the proxy makes no span, and the
    client's ``traceparent`` reaches the engine as it was sent."""

    async def main() -> None:
        traceparent = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
        async with traced_stack("enabled = false") as st:
            assert st.app.context.tracer is NO_TRACING
            await asyncio.to_thread(stream_chat, st.url, traceparent=traceparent)
            proxy, engine = st.flush()
        assert proxy == []
        (llm,) = engine
        assert f"{llm.context.trace_id:032x}" == CLIENT_TRACE_ID
        assert f"{parent_id(llm):016x}" == CLIENT_SPAN_ID

    run(main())


def test_migrated_stream_has_a_migration_span_over_its_continuation() -> None:
    """A stream whose engine crashes mid-way: the first attempt fails with its reason,
    the continuation's attempt is the child of a ``fastroute.migration`` span, and the
    continuation's engine span is under it too."""

    async def main() -> None:
        async with traced_stack("enabled = true") as st:
            sid = "sid-trace-migrate"
            fleet = st.app.context.fleet
            row = fleet.rows[(MODEL, "default")]
            first, second = (int(i) for i in fleet.state.selector.rank(key_hash(sid), row, 2))
            await st.fleet[first].set_faults(crash_after_tokens=2)
            text, _ = await asyncio.to_thread(stream_chat, st.url, **{"x-session-id": sid})
            assert len(text.split()) == MAX_TOKENS
            proxy, engine = st.flush()
        names = by_name(proxy)
        (migration,) = names["fastroute.migration"]
        attempts = sorted(names["fastroute.attempt"], key=lambda s: s.start_time)
        assert [a.attributes["fastroute.engine"] for a in attempts] == [
            f"engine-{first}",
            f"engine-{second}",
        ]
        (request,) = names["fastroute.request"]
        assert parent_id(attempts[0]) == request.context.span_id
        assert not attempts[0].status.is_ok
        assert attempts[0].attributes["fastroute.attempt.retry_reason"]
        assert parent_id(migration) == request.context.span_id
        assert parent_id(attempts[1]) == migration.context.span_id
        assert migration.attributes["fastroute.migration.tokens_sent"] == 2
        assert migration.attributes["fastroute.migration.outcome"] == "success"
        continuation = [s for s in engine if parent_id(s) == attempts[1].context.span_id]
        assert len(continuation) == 1
        assert request.attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS

    run(main())


def test_spans_reach_an_otlp_http_endpoint() -> None:
    """``otlp_endpoint``: the proxy's spans go over OTLP/HTTP protobuf, with the
    configured ``service.name``."""

    async def main() -> None:
        async with serve_otlp_receiver() as (endpoint, receiver):
            async with contextlib.AsyncExitStack() as stack:
                fleet = await stack.enter_async_context(
                    EmulatedFleet(fleet_specs(1, model_name=MODEL, output_lengths=SHORT_OUTPUTS))
                )
                tracing = (
                    f'\n[tracing]\nenabled = true\notlp_endpoint = "{endpoint}"\n'
                    'service_name = "router-test"\nschedule_delay_s = 0.2\n'
                )
                config = decode_config(config_toml(fleet.urls, tracing), source="otlp.toml")
                app = ProxyApp(config)
                url, _ = await stack.enter_async_context(serve_proxy_app(app))
                await asyncio.to_thread(stream_chat, url)
                # The export runs on the processor's thread; the receiver on this loop.
                assert await asyncio.to_thread(app.context.tracer.force_flush)
        spans = receiver.spans
        names = {span.name for span in spans}
        assert {"fastroute.request", "fastroute.attempt", *PROXY_STEPS} <= names
        assert {span.service for span in spans} == {"router-test"}
        assert len({span.trace_id for span in spans}) == 1
        (request,) = [s for s in spans if s.name == "fastroute.request"]
        assert request.attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS
        assert "fastroute.request" in request.line()

    run(main())


def test_a_body_the_proxy_rejects_still_ends_its_request_span() -> None:
    """A 400 (bad JSON) is traced: a classify span with the rejection, a request span with
    the status and no error status (the client's fault)."""

    async def main() -> None:
        async with traced_stack("enabled = true") as st:
            async with aiohttp.ClientSession() as s:
                async with s.post(st.url + "/v1/chat/completions", data=b"{nope") as resp:
                    assert resp.status == 400
                    json.loads(await resp.read())
            proxy, _ = st.flush()
        names = by_name(proxy)
        (request,) = names["fastroute.request"]
        (classify,) = names["fastroute.classify"]
        assert request.attributes["http.response.status_code"] == 400
        assert request.status.is_unset
        assert classify.attributes["fastroute.rejected"]
        assert "fastroute.attempt" not in names

    run(main())


def test_a_pd_request_traces_both_stages() -> None:
    """A P/D request: a pick per stage, an attempt per stage (prefill, then decode), each
    with its engine's span under it."""

    async def main() -> None:
        roles = ("prefill", "decode")
        async with traced_stack("enabled = true", roles=roles) as st:
            text, _ = await asyncio.to_thread(stream_chat, st.url)
            assert len(text.split()) == MAX_TOKENS
            proxy, engine = st.flush()
        names = by_name(proxy)
        picks = {s.attributes["fastroute.stage"]: s for s in names["fastroute.pick"]}
        assert picks["prefill"].attributes["fastroute.pick.engine"] == "prefill-0"
        assert picks["decode"].attributes["fastroute.pick.engine"] == "decode-1"
        attempts = sorted(names["fastroute.attempt"], key=lambda s: s.start_time)
        assert [a.attributes["fastroute.stage"] for a in attempts] == ["prefill", "decode"]
        by_parent = {parent_id(s): s for s in engine}
        for attempt in attempts:
            llm = by_parent[attempt.context.span_id]
            assert llm.attributes["fastroute.engine"] == attempt.attributes["fastroute.engine"]
        assert len({s.context.trace_id for s in [*proxy, *engine]}) == 1

    run(main())
