"""Coverage-guided fuzz targets, one per parser: each takes any bytes and must either
succeed or raise the parser's documented error; anything else is a crash.

Run one with ``python bench/fuzz/target.py NAME [libFuzzer flags] [corpus dirs]``, all of
them with ``python bench/fuzz/run_all.py`` (docs/failure-handling.md, "Fuzzing").
"""

from __future__ import annotations

from collections.abc import Callable

from fastroute.config import decode_config
from fastroute.errors import ConfigError
from fastroute.proxy.path.api_requests import parse_messages, parse_responses
from fastroute.proxy.path.classify import parse_embeddings
from fastroute.proxy.path.requests import RequestParseError, parse_chat, parse_completion
from fastroute.proxy.path.routing_key import estimate_prompt_tokens, routing_key
from fastroute.proxy.path.sse import StreamMeter
from fastroute.proxy.path.sse_dialects import AnthropicStreamMeter, ResponsesStreamMeter
from fastroute.signals.vllm import MetricsParseError, parse_engine_metrics
from fastroute.tables.wire import WireError, decode_snapshot, encode_snapshot

_PARSERS = (parse_chat, parse_completion, parse_responses, parse_messages, parse_embeddings)
_METERS = (StreamMeter, ResponsesStreamMeter, AnthropicStreamMeter)


def fuzz_requests(data: bytes) -> None:
    """Every request-body parser: a request (whose routing key is computed) or a 400."""
    for parse in _PARSERS:
        try:
            parsed = parse(data)
        except RequestParseError:
            continue
        routing_key(parsed, {}, request_id="r")
        estimate_prompt_tokens(parsed)


def _relay(meter: StreamMeter, body: bytes, cut: int) -> bytes:
    out = meter.feed(body[:cut], 0.0) + meter.feed(body[cut:], 1.0)
    return out + meter.finish(2.0)


def fuzz_sse(data: bytes) -> None:
    """The SSE meters: the first byte picks a split point; split and whole relay the
    same bytes and count tokens without an exception.

    Token counts are compared only by the property tests, on well-formed streams
    (tests/unit/proxy/path/test_sse_properties.py): on malformed ones (JSON styles mixed
    after the first event, several ``"content":"`` in one event) the meter's heuristics
    count by read, so the count depends on where reads split; the relayed bytes do not.
    """
    if not data:
        return
    cut, body = data[0] % (len(data)), data[1:]
    for make in _METERS:
        whole, split = make(), make()
        if _relay(whole, body, len(body)) != _relay(split, body, cut):
            raise AssertionError(f"{make.__name__}: split at {cut} relays other bytes")
        if whole.tokens < 0 or split.tokens < 0:
            raise AssertionError(f"{make.__name__}: negative token count")


def fuzz_wire(data: bytes) -> None:
    """The table wire decoder: a table (that round-trips) or a ``WireError``."""
    try:
        snap = decode_snapshot(data)
    except WireError:
        return
    again = decode_snapshot(encode_snapshot(snap))
    if again.checksum != snap.checksum or again.generation != snap.generation:
        raise AssertionError("a decoded table does not round-trip")


def fuzz_config(data: bytes) -> None:
    """The config loader: a ``Config`` or a ``ConfigError``."""
    try:
        decode_config(data, source="fuzz.toml")
    except ConfigError:
        pass


def fuzz_metrics(data: bytes) -> None:
    """The ``/metrics`` parser of every engine dialect: signals or ``MetricsParseError``."""
    text = data.decode("utf-8", "replace")
    for kind in ("vllm", "sglang"):
        try:
            parse_engine_metrics(text, kind)
        except MetricsParseError:
            pass


TARGETS: dict[str, Callable[[bytes], None]] = {
    "requests": fuzz_requests,
    "sse": fuzz_sse,
    "wire": fuzz_wire,
    "config": fuzz_config,
    "metrics": fuzz_metrics,
}
