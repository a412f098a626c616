"""The request path's tracer: the no-op when off, the engine's trace headers, the bounds."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fastroute.config import ConfigError, TracingConfig, decode_config
from fastroute.proxy.tracing import NO_TRACING, RequestTrace, Tracing, build_tracing
from fastroute.testing.configs import engines_toml

ENGINES = engines_toml(["http://127.0.0.1:9"], "m")


def test_tracing_off_is_the_no_op_tracer() -> None:
    tracer = build_tracing(TracingConfig())
    assert tracer is NO_TRACING and not tracer.enabled
    assert tracer.force_flush()
    tracer.shutdown()


def test_tracing_on_builds_an_sdk_tracer_with_a_ratio_sampler() -> None:
    tracer = build_tracing(TracingConfig(enabled=True, sample_ratio=0.25), InMemorySpanExporter())
    try:
        assert isinstance(tracer, Tracing) and tracer.enabled
        description = tracer.provider.sampler.get_description()
        assert "ParentBased" in description and "0.25" in description
    finally:
        tracer.shutdown()


def _trace() -> tuple[Tracing, RequestTrace]:
    tracing = Tracing(TracingConfig(enabled=True), InMemorySpanExporter())
    span = tracing.tracer.start_span("fastroute.request")
    return tracing, RequestTrace(tracing, span)


def test_engine_headers_replace_the_clients_trace_context() -> None:
    """The client's traceparent/tracestate (any case) are dropped, the attempt's added;
    every other line is kept as it was."""
    tracing, trace = _trace()
    try:
        span = tracing.tracer.start_span("fastroute.attempt")
        lines = (
            b"Content-Type: application/json\r\n"
            b"TraceParent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\r\n"
            b"tracestate: vendor=1\r\n"
            b"x-request-id: r1\r\n"
        )
        out = trace.engine_headers(lines, span).split(b"\r\n")
        assert out[:2] == [b"Content-Type: application/json", b"x-request-id: r1"]
        ours = span.get_span_context()
        flags = f"{ours.trace_flags:02x}"  # sampled (and the SDK's "random" bit)
        expected = f"traceparent: 00-{ours.trace_id:032x}-{ours.span_id:016x}-{flags}".encode()
        assert out[2] == expected
        assert [line for line in out if line.lower().startswith(b"trace")] == [expected]
        assert out[-1] == b""
    finally:
        tracing.shutdown()


def test_engine_headers_without_a_client_context_only_add_ours() -> None:
    tracing, trace = _trace()
    try:
        span = tracing.tracer.start_span("fastroute.attempt")
        lines = b"Content-Type: application/json\r\n"
        out = trace.engine_headers(lines, span)
        assert out.startswith(lines) and out.count(b"traceparent: 00-") == 1
        assert out.endswith(b"%02x\r\n" % span.get_span_context().trace_flags)
        assert span.get_span_context().trace_flags.sampled
    finally:
        tracing.shutdown()


@pytest.mark.parametrize(
    ("table", "path"),
    [
        ("max_queue_size = 100\nmax_export_batch_size = 200", "$.tracing.max_export_batch_size"),
        ("sample_ratio = 1.5", "$.tracing.sample_ratio"),
        ('otlp_endpoint = "127.0.0.1:4318"', "$.tracing.otlp_endpoint"),
        ("max_queue_size = 0", "$.tracing.max_queue_size"),
    ],
)
def test_bad_tracing_tables_name_the_field(table: str, path: str) -> None:
    with pytest.raises(ConfigError) as info:
        decode_config(ENGINES + f"\n[tracing]\nenabled = true\n{table}\n", source="t.toml")
    assert path in str(info.value)
