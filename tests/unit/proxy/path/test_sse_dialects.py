"""The Responses and the Anthropic stream meters: token-true counts, usage, errors, ids.

Streams are written as vLLM 0.32 writes them (``event: <type>`` + compact JSON data);
each is fed whole and cut at every byte, so a read boundary never changes the result.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from fastroute.proxy.path.sse_dialects import (
    AnthropicStreamMeter,
    ResponsesStreamMeter,
    event_parts,
)


def _sse(kind: str, data: dict[str, Any], *, named: bool = True) -> bytes:
    head = f"event: {kind}\n".encode() if named else b""
    body = json.dumps({"type": kind, **data}, separators=(",", ":")).encode()
    return head + b"data: " + body + b"\n\n"


def _responses_stream(deltas: list[str], output_tokens: int) -> list[bytes]:
    created = {"response": {"id": "resp_abc", "status": "in_progress", "text": {}, "usage": None}}
    where = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    events = [
        _sse("response.created", created),
        _sse("response.in_progress", created),
        _sse("response.output_item.added", {"item": {"type": "message", "content": []}}),
        _sse("response.content_part.added", {**where, "part": {"type": "output_text", "text": ""}}),
    ]
    events += [_sse("response.output_text.delta", {**where, "delta": d}) for d in deltas]
    text = "".join(deltas)
    usage = {"input_tokens": 11, "output_tokens": output_tokens, "total_tokens": 11 + output_tokens}
    events += [
        _sse("response.output_text.done", {**where, "text": text}),
        _sse("response.content_part.done", {**where, "part": {"text": text}}),
        _sse("response.output_item.done", {"item": {"content": [{"text": text}]}}),
        _sse("response.completed", {"response": {"id": "resp_abc", "usage": usage}}),
    ]
    return events


def _anthropic_stream(deltas: list[str], output_tokens: int, *, ping: bool = True) -> list[bytes]:
    start = {
        "message": {"id": "msg_1", "content": [], "usage": {"input_tokens": 9, "output_tokens": 0}}
    }
    events = [_sse("message_start", start)]
    if ping:
        events.append(_sse("ping", {}))
    events.append(
        _sse("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    )
    events += [
        _sse("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": d}})
        for d in deltas
    ]
    events += [
        _sse("content_block_stop", {"index": 0}),
        _sse(
            "message_delta",
            {"delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": output_tokens}},
        ),
        _sse("message_stop", {}),
    ]
    return events


def _feed_events(meter: Any, events: list[bytes]) -> bytes:
    """One read per event, the n-th at time n; the relayed bytes."""
    out = b"".join(meter.feed(e, float(n)) for n, e in enumerate(events))
    return out + meter.finish(float(len(events)))


def _feed_cut(meter: Any, data: bytes, cut: int) -> bytes:
    return meter.feed(data[:cut], 0.0) + meter.feed(data[cut:], 1.0) + meter.finish(2.0)


@pytest.mark.parametrize(
    ("make", "stream", "first_token_event"),
    [
        (ResponsesStreamMeter, _responses_stream(["Hel", "lo", " you"], 4), 4),
        (AnthropicStreamMeter, _anthropic_stream(["Hel", "lo", " you"], 4), 3),
    ],
    ids=["responses", "anthropic"],
)
def test_tokens_timing_usage_of_each_dialect(make, stream, first_token_event) -> None:
    """Three token events (the engine counted four, its end-of-sequence token too): TTFT
    at the first delta, usage from the final event, TBOT over the engine's count up to
    the end of the output; the bytes are relayed unchanged."""
    meter = make()
    assert _feed_events(meter, stream) == b"".join(stream)
    assert meter.token_events == 3
    assert meter.first_at == first_token_event
    assert meter.last_at == first_token_event + 2
    assert meter.usage is not None and meter.usage.completion_tokens == 4
    assert meter.tokens == 4
    assert meter.end_at == first_token_event + 3
    assert meter.tbot_s == pytest.approx(3 / 3)
    assert meter.error is None


@pytest.mark.parametrize(
    ("make", "stream"),
    [
        (ResponsesStreamMeter, _responses_stream(["a", "b", "", "c"], 3)),
        (AnthropicStreamMeter, _anthropic_stream(["a", "b", "", "c"], 3)),
    ],
    ids=["responses", "anthropic"],
)
def test_any_read_boundary_gives_the_same_counts(make, stream) -> None:
    """Empty deltas carry no token; a read cut anywhere holds the partial event back."""
    data = b"".join(stream)
    for cut in range(len(data) + 1):
        meter = make()
        assert _feed_cut(meter, data, cut) == data
        assert meter.token_events == 3, cut
        assert meter.tokens == 3, cut


def test_responses_meter_reads_the_response_id_and_errors() -> None:
    """The id comes from ``response.created``; ``error`` and ``response.failed`` events and
    the proxy's OpenAI-shaped error event are errors."""
    meter = ResponsesStreamMeter()
    _feed_events(meter, _responses_stream(["x"], 1))
    assert meter.response_id == "resp_abc"
    for event, mark in (
        (_sse("error", {"code": "500", "message": "boom"}), b"boom"),
        (_sse("response.failed", {"response": {"id": "r", "status": "failed"}}), b"failed"),
        (b'data: {"error":{"message":"stream broke","type":"server_error"}}\n\n', b"broke"),
    ):
        meter = ResponsesStreamMeter()
        meter.feed(event, 0.0)
        assert meter.error is not None and mark in meter.error


def test_anthropic_meter_ping_thinking_tool_json_and_error() -> None:
    """``ping`` is no token; thinking and tool-argument deltas are; input tokens come from
    ``message_start``; ``event: error`` is an error."""
    events = [
        _sse("message_start", {"message": {"usage": {"input_tokens": 5, "output_tokens": 1}}}),
        _sse("ping", {}),
        _sse("content_block_delta", {"delta": {"type": "thinking_delta", "thinking": "hm"}}),
        _sse("content_block_delta", {"delta": {"type": "input_json_delta", "partial_json": "{"}}),
        _sse("content_block_delta", {"delta": {"type": "input_json_delta", "partial_json": ""}}),
        _sse("message_delta", {"delta": {}, "usage": {"output_tokens": 2}}),
    ]
    meter = AnthropicStreamMeter()
    _feed_events(meter, events)
    assert meter.token_events == 2
    assert meter.usage is not None
    assert (meter.usage.prompt_tokens, meter.usage.completion_tokens) == (5, 2)
    meter = AnthropicStreamMeter()
    meter.feed(_sse("error", {"error": {"type": "overloaded_error", "message": "busy"}}), 0.0)
    assert meter.error is not None and b"overloaded_error" in meter.error


def test_event_type_from_the_data_when_the_event_line_is_missing() -> None:
    """An event without ``event:`` is typed by its data's ``type``."""
    event = _sse("content_block_delta", {"delta": {"text": "x"}}, named=False)
    assert event_parts(event)[0] == b"content_block_delta"
    meter = AnthropicStreamMeter()
    meter.feed(event, 0.0)
    assert meter.token_events == 1
