"""Property tests of the SSE meters (hypothesis): a stream split at any byte boundaries
is relayed byte for byte as when read whole, with the same token count and usage; any
bytes an engine sends are metered without an exception."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from fastroute.proxy.path.sse import StreamMeter
from fastroute.proxy.path.sse_dialects import AnthropicStreamMeter, ResponsesStreamMeter

METERS = (StreamMeter, ResponsesStreamMeter, AnthropicStreamMeter)


def _data(obj: dict, compact: bool) -> bytes:
    separators = (",", ":") if compact else (", ", ": ")
    return b"data: " + json.dumps(obj, separators=separators).encode() + b"\n\n"


@st.composite
def chat_streams(draw: st.DrawFn) -> bytes:
    compact = draw(st.booleans())
    texts = draw(st.lists(st.text(max_size=6), max_size=12))
    events = [
        _data({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, compact)
    ]
    events += [_data({"choices": [{"index": 0, "delta": {"content": t}}]}, compact) for t in texts]
    events.append(_data({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}, compact))
    if draw(st.booleans()):
        usage = {"prompt_tokens": 3, "completion_tokens": draw(st.integers(0, 50))}
        events.append(_data({"choices": [], "usage": usage}, compact))
    events.append(b"data: [DONE]\n\n")
    return b"".join(events)


@st.composite
def dialect_streams(draw: st.DrawFn) -> bytes:
    texts = draw(st.lists(st.text(max_size=6), max_size=10))
    n = draw(st.integers(0, 40))
    events = [
        b"event: content_block_delta\n"
        + _data({"type": "content_block_delta", "delta": {"type": "text_delta", "text": t}}, True)
        for t in texts
    ]
    events += [
        b"event: response.output_text.delta\n"
        + _data({"type": "response.output_text.delta", "delta": t}, True)
        for t in texts
    ]
    events.append(
        b"event: message_delta\n"
        + _data({"type": "message_delta", "usage": {"output_tokens": n}}, True)
    )
    return b"".join(draw(st.permutations(events)))


def _relay(meter: StreamMeter, body: bytes, cuts: list[int]) -> bytes:
    bounds = [0, *sorted({min(c, len(body)) for c in cuts}), len(body)]
    out = b"".join(
        meter.feed(body[a:b], float(i))
        for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))
    )
    return out + meter.finish(float(len(bounds)))


def _summary(meter: StreamMeter) -> tuple:
    usage = meter.usage
    return meter.tokens, meter.token_events, None if usage is None else usage.completion_tokens


@given(
    st.one_of(chat_streams(), dialect_streams()),
    st.lists(st.integers(0, 4000), max_size=8),
    st.booleans(),
)
def test_any_split_relays_the_same_bytes_and_counts(
    body: bytes, cuts: list[int], strip: bool
) -> None:
    for make in METERS:
        whole, split = make(strip_usage=strip), make(strip_usage=strip)
        relayed_whole = _relay(whole, body, [])
        assert _relay(split, body, cuts) == relayed_whole
        assert _summary(split) == _summary(whole)


@given(st.binary(max_size=400), st.lists(st.integers(0, 400), max_size=6))
def test_any_engine_bytes_are_metered_without_an_exception(body: bytes, cuts: list[int]) -> None:
    for make in METERS:
        meter = make()
        _relay(meter, body, cuts)
        assert meter.tokens >= 0
