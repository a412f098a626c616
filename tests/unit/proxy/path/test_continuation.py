"""The bytes of a mid-stream migration: relayed text, continuation bodies, rewritten events."""

from __future__ import annotations

import msgspec
import pytest

from fastroute.emulator.protocol import SSE_DONE, ChunkEncoder, stream_error_event, usage_dict
from fastroute.proxy.path.continuation import (
    NOT_MIGRATED,
    SegmentRewriter,
    continuation_body,
    relayed_text,
)
from fastroute.proxy.path.migration import Migration

FIRST = ChunkEncoder(True, "chatcmpl-first", 100, "m")
SECOND = ChunkEncoder(True, "chatcmpl-second", 200, "m")
CMPL = ChunkEncoder(False, "cmpl-first", 100, "m")


def _decode(body: bytes | None) -> dict:
    assert body is not None
    return msgspec.json.decode(body)


def _events(data: bytes) -> list[dict]:
    out = []
    for raw in data.split(b"\n\n"):
        if raw.startswith(b"data: ") and raw != b"data: [DONE]":
            out.append(msgspec.json.decode(raw[6:]))
    return out


# -- relayed_text ------------------------------------------------------------------------------


def test_relayed_text_chat_concatenates_content_and_takes_the_first_id() -> None:
    chunks = [FIRST.role() + FIRST.token(" the"), FIRST.token(" of") + FIRST.token(" and")]
    got = relayed_text(chunks, chat=True)
    assert got.text == " the of and"
    assert got.response_id == "chatcmpl-first" and got.created == 100
    assert got.blocker is None


def test_relayed_text_completions_and_non_compact_json() -> None:
    pretty = b'data: {"id": "cmpl-first", "created": 100, "choices": [{"index": 0, "text": " b"}]}'
    got = relayed_text([CMPL.token(" a"), pretty + b"\n\n"], chat=False)
    assert got.text == " a b" and got.response_id == "cmpl-first"


@pytest.mark.parametrize(
    ("event", "why"),
    [
        (FIRST.event(" hm", field="reasoning"), "reasoning"),
        (FIRST.event(" hm", field="reasoning_content"), "reasoning"),
        (
            b'data: {"id":"x","choices":[{"index":0,"delta":{"tool_calls":[{"index":0}]}}]}\n\n',
            "tool calls",
        ),
        (b'data: {"id":"x","choices":[{"index":1,"delta":{"content":" b"}}]}\n\n', "n > 1"),
    ],
)
def test_relayed_text_blockers(event: bytes, why: str) -> None:
    got = relayed_text([FIRST.role(), FIRST.token(" a"), event], chat=True)
    assert got.blocker is not None and why in got.blocker


# -- continuation_body -------------------------------------------------------------------------

CHAT = {
    "model": "m",
    "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 10,
    "max_completion_tokens": 12,
    "min_tokens": 5,
}


def test_chat_continuation_is_a_partial_assistant_turn_with_reduced_limits() -> None:
    body, why = continuation_body(msgspec.json.encode(CHAT), True, " the of", 2)
    got = _decode(body)
    assert why is None
    assert got["messages"] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": " the of"},
    ]
    assert got["continue_final_message"] is True and got["add_generation_prompt"] is False
    assert (got["max_tokens"], got["max_completion_tokens"], got["min_tokens"]) == (8, 10, 3)
    assert got["stream_options"] == CHAT["stream_options"]  # usage still comes back
    assert got["stream"] is True and got["model"] == "m"


def test_chat_continuation_of_a_client_partial_turn_extends_it() -> None:
    own = {
        **CHAT,
        "continue_final_message": True,
        "add_generation_prompt": False,
        "messages": [*CHAT["messages"], {"role": "assistant", "content": "Sure,"}],
    }
    got = _decode(continuation_body(msgspec.json.encode(own), True, " the", 1)[0])
    assert got["messages"][-1] == {"role": "assistant", "content": "Sure, the"}
    assert len(got["messages"]) == 2


def test_min_tokens_never_goes_negative_and_absent_limits_stay_absent() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "stream": True, "min_tokens": 2}
    got = _decode(continuation_body(msgspec.json.encode(body), True, " a b c", 3)[0])
    assert got["min_tokens"] == 0
    assert "max_tokens" not in got and "max_completion_tokens" not in got


@pytest.mark.parametrize("prompt", ["Once upon", ["Once upon"]])
def test_completions_continuation_appends_the_text_to_the_prompt(prompt: object) -> None:
    body = {"model": "m", "prompt": prompt, "max_tokens": 4, "stream": True}
    got = _decode(continuation_body(msgspec.json.encode(body), False, " a time", 2)[0])
    assert got["prompt"] == "Once upon a time" and got["max_tokens"] == 2


@pytest.mark.parametrize("sent", [4, 5])
def test_no_continuation_once_max_tokens_is_used_up(sent: int) -> None:
    body = msgspec.json.encode({"prompt": "x", "max_tokens": 4})
    assert continuation_body(body, False, " a", sent) == (None, NOT_MIGRATED["max_tokens"])


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"n": 2}, "n"),
        ({"best_of": 3}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 2}, "logprobs"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "guided"),
        ({"guided_json": {"type": "object"}}, "guided"),
        ({"structured_outputs": {"regex": "a+"}}, "guided"),
        ({"echo": True}, "echo"),
    ],
)
def test_requests_that_are_not_migrated(extra: dict, why: str) -> None:
    body = msgspec.json.encode({**CHAT, **extra})
    assert continuation_body(body, True, " a", 1) == (None, NOT_MIGRATED[why])


def test_plain_text_response_format_and_n_1_are_migrated() -> None:
    body = msgspec.json.encode({**CHAT, "n": 1, "response_format": {"type": "text"}})
    assert continuation_body(body, True, " a", 1)[1] is None


@pytest.mark.parametrize("prompt", [[1, 2, 3], ["a", "b"], [[1, 2]]])
def test_token_id_and_batched_prompts_are_not_migrated(prompt: object) -> None:
    body = msgspec.json.encode({"prompt": prompt, "max_tokens": 4})
    assert continuation_body(body, False, " a", 1) == (None, NOT_MIGRATED["prompt"])


def test_a_body_that_is_not_an_object_is_not_migrated() -> None:
    assert continuation_body(b"[1]", True, " a", 1) == (None, NOT_MIGRATED["body"])
    assert continuation_body(b"{", True, " a", 1) == (None, NOT_MIGRATED["body"])


# -- SegmentRewriter ---------------------------------------------------------------------------


def test_continuation_events_get_the_first_id_and_created_and_no_role_event() -> None:
    rewriter = SegmentRewriter("chatcmpl-first", 100, tokens_before=2)
    out = rewriter.rewrite(SECOND.role() + SECOND.token(" c"))
    out += rewriter.rewrite(SECOND.token(" d") + SECOND.last(" e", "length"))
    events = _events(out)
    assert len(events) == 3
    assert {e["id"] for e in events} == {"chatcmpl-first"}
    assert {e["created"] for e in events} == {100}
    assert all("role" not in e["choices"][0]["delta"] for e in events)
    assert "".join(e["choices"][0]["delta"]["content"] for e in events) == " c d e"


def test_a_role_event_that_carries_a_token_keeps_the_token() -> None:
    sglang_first = (
        b'data: {"id":"s2","created":200,"choices":[{"index":0,'
        b'"delta":{"role":"assistant","content":" c"}}]}\n\n'
    )
    events = _events(SegmentRewriter("first", 100, 0).rewrite(sglang_first))
    assert events == [
        {"id": "first", "created": 100, "choices": [{"index": 0, "delta": {"content": " c"}}]}
    ]


def test_usage_is_summed_over_the_segments() -> None:
    rewriter = SegmentRewriter("chatcmpl-first", 100, tokens_before=4)
    tail = SECOND.last(" x", "length") + SECOND.usage(usage_dict(30, 8, None)) + SSE_DONE
    out = rewriter.rewrite(SECOND.role() + tail)
    usage = _events(out)[-1]["usage"]
    assert usage["completion_tokens"] == 12 and usage["total_tokens"] == 42
    assert usage["prompt_tokens"] == 30
    assert out.endswith(SSE_DONE) and out.count(b"[DONE]") == 1
    assert _events(out)[-1]["id"] == "chatcmpl-first"


def test_continuous_usage_is_summed_in_every_event() -> None:
    rewriter = SegmentRewriter("chatcmpl-first", 100, tokens_before=3)
    out = rewriter.rewrite(SECOND.event(" a", usage=usage_dict(10, 1, None)))
    out += rewriter.rewrite(SECOND.event(" b", usage=usage_dict(10, 2, None)))
    assert [e["usage"]["completion_tokens"] for e in _events(out)] == [4, 5]


def test_completions_events_are_rewritten_too() -> None:
    cont = ChunkEncoder(False, "cmpl-second", 200, "m")
    events = _events(SegmentRewriter("cmpl-first", 100, 0).rewrite(cont.token(" z")))
    assert events[0]["id"] == "cmpl-first" and events[0]["created"] == 100
    assert events[0]["choices"][0]["text"] == " z"


# -- Migration: what the relay keeps -------------------------------------------------------------


def test_migration_keeps_what_it_relays_and_holds_back_an_error_event() -> None:
    m = Migration(b"{}", limit_bytes=1 << 20)
    tokens = FIRST.role() + FIRST.token(" a")
    assert m.relayed(tokens, errored=False) == tokens
    error = stream_error_event("EngineCore encountered an issue.")
    assert m.relayed(FIRST.token(" b") + error, errored=True) == FIRST.token(" b")
    assert m.cut and m.intact
    assert m.relayed(SSE_DONE, errored=True) == b""
    assert b"".join(m.held_back) == error + SSE_DONE
    assert relayed_text(m.kept or [], chat=True).text == " a b"


def test_migration_over_its_bound_relays_as_if_it_did_not_exist() -> None:
    m = Migration(b"{}", limit_bytes=len(FIRST.token(" a")) + 1)
    assert m.relayed(FIRST.token(" a"), errored=False) == FIRST.token(" a")
    error = stream_error_event("boom")
    data = FIRST.token(" b") + error
    assert m.relayed(data, errored=True) == data  # over the bound: the error passes
    assert not m.intact and not m.cut
