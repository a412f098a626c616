"""Token-true measurement of relayed SSE streams over recorded event sequences."""

from __future__ import annotations

import math

import msgspec
import pytest

from fastroute.proxy.path.sse import MAX_HELD_BYTES, StreamMeter, ask_for_usage, has_token

HEAD = b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
VLLM_ROLE = HEAD + (
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
    b'"logprobs":null,"finish_reason":null}]}\n\n'
)
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}\n\n'
DONE = b"data: [DONE]\n\n"
VLLM_ERROR = (
    b'data: {"error": {"message": "EngineCore encountered an issue. See stack trace (above) '
    b'for the root cause.", "type": "InternalServerError", "param": null, "code": 500}}\n\n'
)


def token(i: int) -> bytes:
    return b'data: {"choices":[{"index":0,"delta":{"content":" w%d"}}]}\n\n' % i


def vllm_event(text: str, finish: str | None = None, field: str = "content") -> bytes:
    fin = b"null" if finish is None else b'"%s","stop_reason":null' % finish.encode()
    delta = msgspec.json.encode({field: text})
    return HEAD + b'"choices":[{"index":0,"delta":%s,"logprobs":null,"finish_reason":%s}]}\n\n' % (
        delta,
        fin,
    )


def vllm_usage(n: int) -> bytes:
    return HEAD + (
        b'"choices":[],"usage":{"prompt_tokens":9,"total_tokens":%d,"completion_tokens":%d}}\n\n'
        % (9 + n, n)
    )


def measure(chunks: list[bytes], strip_usage: bool = False) -> tuple[StreamMeter, bytes]:
    """Feed one read per second; the meter and what was relayed."""
    meter = StreamMeter(strip_usage)
    out = b"".join(meter.feed(c, float(t)) for t, c in enumerate(chunks))
    return meter, out + meter.finish(float(len(chunks)))


@pytest.mark.parametrize(
    "chunks, expected",
    [
        ([ROLE, token(0), token(1), token(2), DONE], 3),  # chat, one event per chunk
        ([ROLE + token(0), token(1), token(2) + DONE], 3),  # coalesced reads
        ([ROLE, token(0), token(1), token(2), USAGE, DONE], 3),  # include_usage
        ([ROLE, token(0), token(1), token(2) + USAGE + DONE], 3),
        ([token(0), token(1), DONE], 2),  # completions: no role event
        ([token(0), token(1)], 2),  # stream cut before [DONE]
        ([ROLE, DONE], 0),  # empty output
        ([ROLE], 0),
    ],
)
def test_only_events_with_a_token_count(chunks, expected):
    assert measure(chunks)[0].token_events == expected


def test_an_eight_token_chat_stream_has_seven_gaps_not_nine():
    chunks = [ROLE] + [token(i) for i in range(8)] + [DONE]
    meter, _ = measure(chunks)
    assert len(chunks) - 1 == 9  # what the chunk count gave once: TBOT 22 % low
    assert meter.tokens - 1 == 7
    assert meter.first_at == 1.0 and meter.last_at == 8.0 and meter.tbot_s == 1.0


def test_vllm_stream_interval_1_with_merged_events_uses_the_engines_count():
    # 6 tokens, the reader lagged once: events of 1, 1, 2, 1, 1 tokens
    texts = ["a", "b", "cd", "e"]
    chunks = [VLLM_ROLE + vllm_event(texts[0])] + [vllm_event(t) for t in texts[1:]]
    chunks += [vllm_event("f", "length"), vllm_usage(6) + DONE]
    meter, _ = measure(chunks)
    assert meter.token_events == 5 and meter.tokens == 6
    assert meter.first_at == 0.0 and meter.last_at == 4.0
    assert meter.tbot_s == pytest.approx(4.0 / 5)
    without_usage, _ = measure(chunks[:-1] + [DONE])
    assert without_usage.tokens == 5 and without_usage.tbot_s == pytest.approx(1.0)


def test_vllm_stream_interval_4_is_token_true_with_usage():
    # 64 tokens at stream_interval 4: events of 1, 4 x 15, 3 (17 events), 1 s apart
    chunks = [VLLM_ROLE + vllm_event("t")] + [vllm_event("tttt") for _ in range(15)]
    chunks += [vllm_event("ttt", "length"), vllm_usage(64), DONE]
    meter, _ = measure(chunks)
    assert meter.token_events == 17 and meter.tokens == 64
    assert meter.tbot_s == pytest.approx(16.0 / 63)  # not 16 / 16: 3.94x the truth


def test_a_final_empty_delta_is_no_token_but_ends_the_engines_count():
    chunks = [VLLM_ROLE, vllm_event("a"), vllm_event("b"), vllm_event("c")]
    chunks += [vllm_event("", "stop"), vllm_usage(4), DONE]
    meter, _ = measure(chunks)
    assert meter.token_events == 3 and meter.tokens == 4  # the EOS token counts in usage
    assert meter.first_at == 1.0 and meter.end_at == 4.0
    assert meter.tbot_s == pytest.approx(1.0)  # 1..4 over 3 gaps
    no_usage, _ = measure(chunks[:-2] + [DONE])
    assert no_usage.tokens == 3 and no_usage.tbot_s == pytest.approx(1.0)  # 1..3 over 2


def test_llamacpp_progress_events_are_not_the_first_token():
    progress = (
        b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant",'
        b'"content":null}}],"prompt_progress":{"total":9,"cache":0,"processed":%d}}\n\n'
    )
    chunks = [progress % 4, progress % 9, token(0), token(1), DONE]
    meter, _ = measure(chunks)
    assert meter.first_at == 2.0 and meter.token_events == 2


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_reasoning_deltas_are_tokens(field):
    chunks = [VLLM_ROLE, vllm_event("think", field=field), vllm_event("so", field=field)]
    chunks += [vllm_event("answer", "length"), DONE]
    meter, _ = measure(chunks)
    assert meter.first_at == 1.0 and meter.token_events == 3


def test_tool_call_and_completion_text_events_are_tokens_empty_ones_not():
    assert has_token(b'data: {"choices":[{"delta":{"tool_calls":[{"index":0}]}}]}\n\n')
    assert not has_token(b'data: {"choices":[{"delta":{"tool_calls":[]}}]}\n\n')
    assert has_token(b'data: {"choices":[{"index":0,"text":" x","logprobs":null}]}\n\n')
    assert not has_token(b'data: {"choices":[{"index":0,"text":"","finish_reason":"stop"}]}\n\n')
    assert not has_token(b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\n\n')
    # logprobs' content is a list, not a token string
    assert not has_token(b'data: {"choices":[{"delta":{"content":""},"logprobs":{"content":[]}}]}')


def test_non_compact_json_is_decoded():
    assert has_token(b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n')
    assert not has_token(b'data: {"choices": [{"delta": {"content": ""}}]}\n\n')
    assert not has_token(b'data: {"choices": [{"delta": {"content": null}}]}\n\n')
    assert not has_token(VLLM_ERROR)


def test_an_in_stream_error_is_no_token_and_is_kept():
    chunks = [VLLM_ROLE, vllm_event("a"), vllm_event("b"), VLLM_ERROR + DONE]
    meter, out = measure(chunks)
    assert meter.token_events == 2 and meter.error is not None
    assert msgspec.json.decode(meter.error)["error"]["code"] == 500
    assert out == b"".join(chunks)  # relayed as the engine wrote it


def test_a_usage_event_the_client_did_not_ask_for_is_stripped_exactly():
    chunks = [VLLM_ROLE, vllm_event("a"), vllm_event("b", "length"), vllm_usage(2), DONE]
    meter, out = measure(chunks, strip_usage=True)
    assert meter.tokens == 2 and out == b"".join(chunks[:3] + chunks[4:])
    joined = b"".join(chunks[2:])  # usage inside a read of several events
    meter, out = measure([chunks[0] + chunks[1], joined], strip_usage=True)
    assert out == chunks[0] + chunks[1] + chunks[2] + DONE and meter.tokens == 2
    kept, out = measure(chunks)  # the client asked: unchanged
    assert out == b"".join(chunks) and kept.tokens == 2


def test_events_split_across_reads_are_measured_and_relayed_whole():
    stream = VLLM_ROLE + vllm_event("a") + vllm_event("b") + vllm_usage(2) + DONE
    for size in (1, 7, 50, 333):
        reads = [stream[i : i + size] for i in range(0, len(stream), size)]
        meter, out = measure(reads, strip_usage=True)
        assert out == VLLM_ROLE + vllm_event("a") + vllm_event("b") + DONE, size
        assert meter.token_events == 2 and meter.tokens == 2, size
        meter, out = measure(reads)
        assert out == stream, size


def test_an_endless_partial_event_is_not_held_forever():
    meter = StreamMeter()
    big = b"data: " + b"x" * MAX_HELD_BYTES
    assert meter.feed(big[:100], 0.0) == b""
    assert meter.feed(big[100:], 1.0) == big  # past the limit: relayed as it is


def test_no_token_no_tbot():
    meter, _ = measure([ROLE, DONE])
    assert meter.tokens == 0 and meter.tbot_s is None and math.isnan(meter.first_at)
    one, _ = measure([ROLE, token(0), DONE])
    assert one.tokens == 1 and one.tbot_s is None


@pytest.mark.parametrize(
    "body",
    [
        b'{"model":"m","stream":true,"messages":[]}',
        b'  {"stream": true, "messages": [{"role": "user", "content": "stream_options"}]}',
        b'{"stream":true,"stream_options":null}',
        b'{"stream":true,"stream_options":{"include_usage":false,"continuous_usage_stats":true}}',
        b'{"stream":true,"stream_options":{}}',
    ],
)
def test_ask_for_usage_adds_include_usage_exactly(body):
    options = msgspec.json.decode(body).get("stream_options", msgspec.UNSET)
    asked = ask_for_usage(body, options)
    assert asked is not None
    original, edited = msgspec.json.decode(body), msgspec.json.decode(asked)
    assert edited["stream_options"]["include_usage"] is True
    assert {k: v for k, v in edited.items() if k != "stream_options"} == {
        k: v for k, v in original.items() if k != "stream_options"
    }
    for key, value in (original.get("stream_options") or {}).items():
        if key != "include_usage":
            assert edited["stream_options"][key] == value
    assert asked.count(b'"stream_options"') == 1 + body.count(b'"content": "stream_options"')


def test_ask_for_usage_leaves_a_body_that_asks_alone():
    body = b'{"stream":true,"stream_options":{"include_usage":true}}'
    assert ask_for_usage(body, {"include_usage": True}) is None
