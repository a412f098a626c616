"""Token-true in-band measurement through the real proxy against emulated engines that
stream the way real ones do: several tokens per event, an empty final delta, progress
events, reasoning deltas, usage only when asked, in-stream errors."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from proxy_harness import Harness, decision_record

MAX_TOKENS = 32


async def timed_sse(resp: aiohttp.ClientResponse) -> list[tuple[float, Any]]:
    """(arrival time, parsed data or ``"[DONE]"``) of each event."""
    loop = asyncio.get_running_loop()
    out: list[tuple[float, Any]] = []
    async for raw in resp.content:
        line = raw.strip()
        if line:
            assert line.startswith(b"data: "), line
            data = line[6:]
            out.append((loop.time(), "[DONE]" if data == b"[DONE]" else json.loads(data)))
    return out


def has_token(event: Any) -> bool:
    for c in event.get("choices") or ():
        d = c.get("delta") or {}
        if c.get("text") or d.get("content") or d.get("reasoning") or d.get("reasoning_content"):
            return True
    return False


async def stream_once(h: Harness, url: str, body: dict[str, Any]) -> tuple[list, dict, float]:
    """(the timed events, the decision record, when the request was sent)."""
    async with aiohttp.ClientSession() as s:
        sent_at = asyncio.get_running_loop().time()
        async with s.post(url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            rid = resp.headers["x-request-id"]
            events = await timed_sse(resp)
        await asyncio.sleep(0.05)  # the record is complete once the handler returned
        return events, await decision_record(s, url, rid), sent_at


def assert_span_is_causal(
    record: dict[str, Any], engine: Any, sent_at: float, first_at: float, last_at: float
) -> None:
    """The proxy's first-to-last token span (``tbot_s`` × (tokens − 1); the token count is
    checked exactly apart) lies within what causality allows, on the one clock the client,
    proxy and in-process engine share.

    The engine emits its first and last token (its own TTFT and end-to-end histograms, one
    request) before the proxy reads them, and the proxy reads each before the client. A stall
    of this process between the proxy's read and the client's (a loaded machine) widens the
    window by exactly the stall, so the bounds hold under any scheduling; on a quiet machine
    they are within the router's overhead of the engine's own span.
    """
    tokens = record["attempts"][0]["output_tokens"]
    span_s = record["timings"]["tbot_s"] * (tokens - 1)
    engine_ttft_s = engine.ttft.sum
    engine_span_s = engine.e2e.sum - engine_ttft_s  # its last token's time minus its first's
    client_ttft_s = first_at - sent_at
    slack_s = 1e-3  # float sums and clock reads
    # Arrival ≥ sent_at: the engine's first token is at ≥ sent_at + its TTFT.
    assert span_s <= last_at - sent_at - engine_ttft_s + slack_s
    # The proxy's first read ≤ the client's; its last read ≥ the engine's last token.
    assert span_s >= engine_span_s - (client_ttft_s - engine_ttft_s) - slack_s
    assert engine.ttft.count == engine.e2e.count == 1


CASES = {
    "interval-1": ({"stream_interval": 1}, {}),
    "interval-4": ({"stream_interval": 4}, {}),
    "request-interval-4": ({}, {"stream_interval": 4}),
    "final-empty-delta": ({"final_empty_delta": True}, {}),
    "llamacpp-progress": ({"kind": "llamacpp"}, {"return_progress": True}),
    "vllm-reasoning": ({"kind": "vllm", "reasoning_tokens": 5}, {}),
    "sglang-reasoning": ({"kind": "sglang", "reasoning_tokens": 5}, {}),
}


@pytest.mark.parametrize("client_usage", [False, True], ids=["no-usage", "usage"])
@pytest.mark.parametrize("case", list(CASES))
def test_tbot_and_tokens_are_token_true(h: Harness, case: str, client_usage: bool) -> None:
    engine_options, extra = CASES[case]
    stop = case == "final-empty-delta"  # ends on an empty EOS event: needs a stop

    async def main() -> None:
        async with h.proxy_stack(1, engine_options=engine_options) as st:
            body = h.chat_body("tell me a story", stream=True, max_tokens=MAX_TOKENS, **extra)
            if client_usage:
                body["stream_options"] = {"include_usage": True}
            if not stop:
                body["ignore_eos"] = True
            else:
                body["min_tokens"] = 20  # the emulator stops at 20 of 32, on an empty EOS
            events, record, sent_at = await stream_once(h, st.url, body)
            data = [e for _, e in events if e != "[DONE]"]
            finish = data[-2 if client_usage else -1]["choices"][0]["finish_reason"]
            assert finish == ("stop" if stop else "length")
            if stop:  # the end-of-sequence event has no text, but counts in usage
                assert data[-2 if client_usage else -1]["choices"][0]["delta"]["content"] == ""
            assert events[-1][1] == "[DONE]"
            usage_events = [e for e in data if e.get("choices") == []]
            token_times = [t for t, e in events if e != "[DONE]" and has_token(e)]
            end_times = [t for t, e in events if e != "[DONE]" and e.get("choices")]
            if client_usage:  # it asked: the engine's usage event, unchanged
                assert len(usage_events) == 1 and data[-1] is usage_events[0]
                true_tokens = usage_events[0]["usage"]["completion_tokens"]
            else:  # it did not: the proxy asked for it, and took it out
                assert usage_events == [] and all("usage" not in e for e in data)
                true_tokens = MAX_TOKENS
            if stop and not client_usage:  # one token per event, and the empty EOS one
                true_tokens = len(token_times) + 1
            if not stop:
                assert true_tokens == MAX_TOKENS
            attempt = record["attempts"][0]
            assert attempt["outcome"] == "success"
            assert attempt["output_tokens"] == true_tokens
            last = end_times[-1] if stop else token_times[-1]
            assert_span_is_causal(record, st.fleet[0].metrics, sent_at, token_times[0], last)
            if extra.get("stream_interval") == 4 or engine_options.get("stream_interval") == 4:
                assert len(token_times) < true_tokens / 3  # several tokens per event

    h.run(main())


def test_ttft_is_the_first_token_not_the_progress_events(h: Harness) -> None:
    async def main() -> None:
        async with h.proxy_stack(1, engine_options={"kind": "llamacpp"}) as st:
            body = h.chat_body(
                "x " * 3000, stream=True, max_tokens=8, ignore_eos=True, return_progress=True
            )
            async with aiohttp.ClientSession() as s:
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                async with s.post(st.url + "/v1/chat/completions", json=body) as resp:
                    rid = resp.headers["x-request-id"]
                    events = await timed_sse(resp)
                await asyncio.sleep(0.05)
                record = await decision_record(s, st.url, rid)
            first = next(t for t, e in events if e != "[DONE]" and has_token(e))
            progress = [t for t, e in events if e != "[DONE]" and "prompt_progress" in e]
            assert progress and progress[0] <= first
            ttft = record["timings"]["first_token"]
            assert ttft == pytest.approx(first - t0, abs=0.02)
            assert ttft >= record["timings"]["first_byte"]

    h.run(main())


def test_an_in_stream_error_event_is_an_engine_fault_not_a_token(h: Harness) -> None:
    async def main() -> None:
        async with h.proxy_stack(1) as st:
            engine = st.fleet.engines[0]
            await engine.set_faults(stream_error_after_tokens=5)
            body = h.chat_body("tell me a story", stream=True, max_tokens=20, ignore_eos=True)
            events, record, _ = await stream_once(h, st.url, body)
            data = [e for _, e in events if e != "[DONE]"]
            assert events[-1][1] == "[DONE]"  # the stream ended cleanly
            assert data[-1]["error"]["type"] == "InternalServerError"  # as the engine sent it
            assert data[-1]["error"]["code"] == 500
            attempt = record["attempts"][0]
            assert attempt["outcome"] == "http_5xx" and "in-stream error" in attempt["detail"]
            assert record["error"] == attempt["detail"]
            assert attempt["output_tokens"] == 5  # the error event is no token
            failures = st.ctx.metrics.upstream_failures.labels(attempt["engine"], "http_5xx")
            assert failures._value.get() == 1

    h.run(main())


def test_a_prompt_is_queued_until_its_first_token_not_its_progress_events(h: Harness) -> None:
    """The stats block's queued prompt tokens (prefix-hrw's load): a stream's prompt
    leaves them at its first token event, not at the llama.cpp progress events before
    it, while the stream stays in flight; a JSON answer's at its end."""

    async def main() -> None:
        async with h.proxy_stack(1, engine_options={"kind": "llamacpp"}) as st:
            stats = st.ctx.fleet.stats
            # ~5.7 k prompt tokens: about 170 ms of emulated prefill between the progress
            # events and the first token, the margin this test reads the count in.
            body = h.chat_body(
                "x " * 9000, stream=True, max_tokens=400, ignore_eos=True, return_progress=True
            )
            async with aiohttp.ClientSession() as s:
                async with s.post(st.url + "/v1/chat/completions", json=body) as resp:
                    queued_at_progress = []
                    async for raw in resp.content:
                        line = raw.strip()
                        if not line.startswith(b"data: {"):
                            continue
                        event = json.loads(line[6:])
                        if has_token(event):
                            break
                        if "prompt_progress" in event:
                            queued_at_progress.append(int(stats.queued_tokens()[0]))
                    # The prompt is queued while the engine reports progress on it (its
                    # prefill takes longer than two loopback hops), and not after its
                    # first token.
                    assert queued_at_progress and queued_at_progress[0] > 1000
                    assert stats.queued_tokens().tolist() == [0]
                    assert stats.in_flight_tokens()[0] > 400  # still streaming: prompt + budget
                plain = h.chat_body("x " * 500, max_tokens=2)
                async with s.post(st.url + "/v1/chat/completions", json=plain) as resp:
                    assert resp.status == 200
            await h.wait_until(lambda: stats.in_flight().tolist() == [0], timeout=5.0)
            assert stats.queued_tokens().tolist() == [0]
            assert stats.in_flight_tokens().tolist() == [0]

    h.run(main())


def test_a_prefix_the_policy_expects_cached_is_not_queued(h: Harness) -> None:
    """The default policy's decision says how much of the prompt it expects cached at its
    chosen engine (``cached_tokens``: 4096 tokens once the prompt's 16 kB depth was
    routed there), and the stats block counts only the rest as queued prefill: the second
    request of the same long prompt queues thousands of tokens fewer than the first."""

    async def queued_at_first_progress(s: aiohttp.ClientSession, url: str, body: dict) -> int:
        async with s.post(url + "/v1/chat/completions", json=body) as resp:
            async for raw in resp.content:
                line = raw.strip()
                if line.startswith(b"data: {") and "prompt_progress" in json.loads(line[6:]):
                    return int(st.ctx.fleet.stats.queued_tokens()[0])
        raise AssertionError("no progress event")

    async def main() -> None:
        nonlocal st
        async with h.proxy_stack(1, engine_options={"kind": "llamacpp"}) as st:
            body = h.chat_body(
                "x " * 9000, stream=True, max_tokens=4, ignore_eos=True, return_progress=True
            )
            async with aiohttp.ClientSession() as s:
                first = await queued_at_first_progress(s, st.url, body)
                await h.wait_until(lambda: st.ctx.fleet.stats.in_flight().tolist() == [0], 5.0)
                second = await queued_at_first_progress(s, st.url, body)
            assert first > 4000  # ~4.5 k tokens estimated, nothing expected cached
            assert 0 < second <= first - 4000  # the 16 kB depth (4096 tokens) is not queued

    st: Any = None
    h.run(main())
