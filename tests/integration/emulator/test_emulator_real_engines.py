"""The emulator's options that make it stream, fail and report as real engines do.

What real engines do is recorded in docs/real-engines.md (vLLM 0.32 measured, SGLang and
llama.cpp from their sources): multi-token events, the empty final delta of an end-of-sequence
token, in-stream errors, ``cached_tokens`` only when enabled, reasoning deltas, llama.cpp's
progress events, SGLang's flat error shape and each engine's ``/metrics`` dialect.
"""

from __future__ import annotations

import json
import math
from typing import Any

import aiohttp
import pytest

from fastroute.emulator.faults import FaultState
from fastroute.emulator.model import OutputLengthDistribution
from fastroute.emulator.server import DEFAULT_MODEL_NAME, EmulatedFleet, EngineSpec
from fastroute.signals.vllm import parse_engine_metrics

pytestmark = pytest.mark.integration

MODEL = DEFAULT_MODEL_NAME
MSGS = [{"role": "user", "content": "Hello there!"}]
FIVE_THEN_STOP = OutputLengthDistribution(mu=math.log(5), sigma=0.0)


async def _post(url: str, body: dict[str, Any]) -> tuple[int, list[dict[str, Any]], Any]:
    """POST; the status, the SSE events (``{"done": True}`` for [DONE]) or the JSON body."""
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json=body) as resp:
            if resp.content_type != "text/event-stream":
                return resp.status, [], await resp.json()
            events = []
            async for raw in resp.content:
                line = raw.strip()
                if line.startswith(b"data: "):
                    payload = line[6:]
                    events.append({"done": True} if payload == b"[DONE]" else json.loads(payload))
            return resp.status, events, None


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MSGS, "stream": True, **extra}


def _tokens_per_event(events: list[dict[str, Any]]) -> list[int]:
    """From ``continuous_usage_stats``: completion tokens each choice event added."""
    out, last = [], 0
    for e in events:
        if e.get("choices") and e.get("usage"):
            n = e["usage"]["completion_tokens"]
            if n > last:
                out.append(n - last)
            last = n
    return out


def test_stream_interval_groups_tokens_like_vllm(arun):
    """First token alone, then ``stream_interval`` per event (vLLM 0.32: 9 tokens at 4 → 1, 4, 4);
    a request's ``stream_interval`` overrides the engine's; below 1 is a 400."""

    async def main():
        async with EmulatedFleet([EngineSpec(stream_interval=4)]) as fleet:
            url = fleet.urls[0] + "/v1/chat/completions"
            usage = {"include_usage": True, "continuous_usage_stats": True}
            pinned = {"ignore_eos": True, "stream_options": usage}
            status, events, _ = await _post(url, _chat(max_tokens=9, **pinned))
            assert status == 200 and _tokens_per_event(events) == [1, 4, 4]
            assert events[0]["choices"][0]["delta"]["role"] == "assistant"
            assert events[0]["usage"]["completion_tokens"] == 0
            assert events[-3]["choices"][0]["finish_reason"] == "length"
            assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 9
            assert events[-1] == {"done": True}

            _, events, _ = await _post(url, _chat(max_tokens=6, stream_interval=2, **pinned))
            assert _tokens_per_event(events) == [1, 2, 2, 1]
            _, events, _ = await _post(url, _chat(max_tokens=6, stream_interval=1, **pinned))
            assert _tokens_per_event(events) == [1] * 6

            status, _, body = await _post(url, _chat(max_tokens=6, stream_interval=0))
            assert status == 400 and body["error"]["param"] == "stream_interval"

    arun(main())


def test_a_stop_ends_on_an_empty_final_delta(arun):
    async def main():
        spec = EngineSpec(final_empty_delta=True, output_lengths=FIVE_THEN_STOP)
        async with EmulatedFleet([spec]) as fleet:
            _, events, _ = await _post(fleet.urls[0] + "/v1/chat/completions", _chat(max_tokens=50))
            choices = [e["choices"][0] for e in events if e.get("choices")]
            assert choices[-1] == {
                "index": 0, "delta": {"content": ""}, "logprobs": None,
                "finish_reason": "stop", "stop_reason": None,
            }  # fmt: skip
            assert all(c["delta"].get("content") for c in choices[1:-1])  # 4 tokens with text
            assert len(choices) == 1 + 5  # the role event and five tokens

    arun(main())


def test_stream_error_fault_breaks_the_stream_in_stream(arun):
    """After N tokens: one error event in vLLM's shape, then [DONE], status 200 already sent;
    a JSON request gets the 500 instead."""

    async def main():
        spec = EngineSpec(faults=FaultState(stream_error_after_tokens=3))
        async with EmulatedFleet([spec]) as fleet:
            url = fleet.urls[0] + "/v1/chat/completions"
            status, events, _ = await _post(url, _chat(max_tokens=10, ignore_eos=True))
            assert status == 200
            texts = [e for e in events if e.get("choices")]
            assert len(texts) == 1 + 3
            assert events[-2] == {
                "error": {
                    "message": "EngineCore encountered an issue. See stack trace (above) for "
                    "the root cause.",
                    "type": "InternalServerError", "param": None, "code": 500,
                }
            }  # fmt: skip
            assert events[-1] == {"done": True}
            status, _, body = await _post(url, {**_chat(max_tokens=10), "stream": False})
            assert status == 500 and body["error"]["code"] == 500
            assert fleet[0].faults.injected_total["stream_error"] == 2

    arun(main())


def test_cached_tokens_only_when_enabled(arun):
    async def main():
        specs = [EngineSpec(name="on"), EngineSpec(name="off", prompt_tokens_details=False)]
        async with EmulatedFleet(specs) as fleet:
            for url, details in zip(fleet.urls, ({"cached_tokens": 0}, None), strict=True):
                body = {"model": MODEL, "messages": MSGS, "max_tokens": 2}
                _, _, reply = await _post(url + "/v1/chat/completions", body)
                assert reply["usage"]["prompt_tokens_details"] == details

    arun(main())


@pytest.mark.parametrize(
    ("kind", "field"), [("vllm", "reasoning"), ("sglang", "reasoning_content")]
)
def test_reasoning_deltas(arun, kind: str, field: str):
    """The first ``reasoning_tokens`` tokens are reasoning (vLLM ``reasoning``, SGLang
    ``reasoning_content``), never in one event with content; JSON has them beside content."""

    async def main():
        async with EmulatedFleet([EngineSpec(kind=kind, reasoning_tokens=3)]) as fleet:
            url = fleet.urls[0] + "/v1/chat/completions"
            _, events, _ = await _post(url, _chat(max_tokens=5, ignore_eos=True))
            deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")][1:]
            assert [list(d) for d in deltas] == [[field]] * 3 + [["content"]] * 2
            assert all(d[field] for d in deltas[:3])
            _, _, reply = await _post(
                url, {**_chat(max_tokens=5, ignore_eos=True), "stream": False}
            )
            message = reply["choices"][0]["message"]
            assert message[field] and len(message["content"].split()) == 2
            assert reply["usage"]["completion_tokens"] == 5

    arun(main())


def test_llamacpp_progress_events_and_metrics(arun):
    async def main():
        async with EmulatedFleet([EngineSpec(kind="llamacpp")]) as fleet:
            url = fleet.urls[0]
            _, events, _ = await _post(
                url + "/v1/chat/completions", _chat(max_tokens=2, return_progress=True)
            )
            progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
            assert len(progress) == 2 and progress[-1]["processed"] == progress[-1]["total"] > 0
            assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
            _, plain, _ = await _post(url + "/v1/chat/completions", _chat(max_tokens=2))
            assert not any("prompt_progress" in e for e in plain)
            async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as resp:
                text = await resp.text()
            assert "llamacpp:requests_processing" in text and "vllm:" not in text
            assert "_bucket" not in text.replace("fastroute_emulator", "")
            signals = parse_engine_metrics(text, "llamacpp")[""]
            assert signals.num_requests_running == 0.0 and signals.num_requests_waiting == 0.0

    arun(main())


def test_sglang_metrics_and_flat_errors(arun):
    async def main():
        async with EmulatedFleet([EngineSpec(kind="sglang")]) as fleet:
            url = fleet.urls[0]
            body = {"model": MODEL, "messages": MSGS, "max_tokens": 3, "ignore_eos": True}
            status, _, _ = await _post(url + "/v1/chat/completions", body)
            assert status == 200
            status, _, err = await _post(url + "/v1/chat/completions", {**body, "model": "nope"})
            assert status == 404
            assert err == {
                "object": "error", "message": "The model `nope` does not exist.",
                "type": "NotFoundError", "param": "model", "code": 404,
            }  # fmt: skip
            async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as resp:
                text = await resp.text()
            assert "vllm:" not in text
            s = parse_engine_metrics(text, "sglang")[MODEL]
            assert s.ttft_s is not None and s.ttft_s.count == 1
            assert s.prefix_cache_queries_total is not None and s.prefix_cache_queries_total > 0
            assert s.prefix_cache_hit_rate == 0.0 and s.kv_cache_usage is not None

    arun(main())
