"""Behaviour under load over HTTP: queueing, batching, KV exhaustion, counters that add up."""

from __future__ import annotations

import asyncio
import statistics
import time

import aiohttp
import pytest

from fastroute.emulator.model import EngineConfig
from fastroute.emulator.server import EmulatedFleet, EngineSpec

pytestmark = pytest.mark.integration


async def _stream_ttft(s, url, read_sse, prompt, max_tokens=2):
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    async with s.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        _, times, done = await read_sse(resp)
    assert done
    return times[0] - t0


def test_ttft_grows_with_queue_depth_and_prompt_length(arun, read_sse):
    """Through HTTP: a burst queues behind prefills, and a longer prompt takes longer."""

    async def main():
        async with EmulatedFleet([EngineSpec(profile="h100")]) as fleet:
            url = fleet.urls[0]
            async with aiohttp.ClientSession() as s:
                prompt = "word " * 800  # 1000 tokens
                # the idle TTFT: scheduling noise on a shared machine only adds time, so the
                # fastest of three is the estimate (a median let two hiccups fail the test)
                alone = min([await _stream_ttft(s, url, read_sse, prompt) for _ in range(3)])
                # the queue wait grows with the burst: measured max/idle 1.7-3.0 at 24 prompts
                # (CI failed at 2.98 < 3), 5.6-5.9 at 96, so 96 leaves a margin for the bounds
                burst = await asyncio.gather(
                    *(_stream_ttft(s, url, read_sse, prompt + str(i)) for i in range(96))
                )
                long_ = await _stream_ttft(s, url, read_sse, "word " * 6000)
        assert statistics.median(burst) > 2 * alone
        assert max(burst) > 3 * alone
        assert long_ > 2 * alone

    arun(main())


def test_tbot_grows_with_batch_size(arun, scrape):
    """The engine's inter-token latency histogram mean rises when 32 streams share the batch."""

    async def run_batch(n):
        async with EmulatedFleet([EngineSpec(profile="h100")]) as fleet:
            url = fleet.urls[0]
            async with aiohttp.ClientSession() as s:

                async def one(i):
                    body = {"prompt": f"{i} " + "context " * 400, "max_tokens": 20,
                            "ignore_eos": True}  # fmt: skip
                    async with s.post(url + "/v1/completions", json=body) as resp:
                        assert resp.status == 200

                await asyncio.gather(*(one(i) for i in range(n)))
                m = await scrape(s, url)
        return (
            m["vllm:inter_token_latency_seconds_sum"] / m["vllm:inter_token_latency_seconds_count"]
        )

    async def main():
        return await run_batch(1), await run_batch(32)

    single, batched = arun(main())
    print(f"mean ITL: 1 stream {single * 1e3:.2f} ms, 32 streams {batched * 1e3:.2f} ms")
    assert batched > 1.5 * single


def test_kv_exhaustion_preempts_and_every_counter_adds_up(arun, scrape, wait_until):
    """A tiny KV cache forces preemption; all requests still succeed and metrics match usage."""

    async def main():
        cfg = EngineConfig(num_blocks=32)  # 512 tokens for 6 x (150 + 80)
        async with EmulatedFleet([EngineSpec(profile="h100", config=cfg)]) as fleet:
            engine = fleet[0]
            seen_waiting = 0

            async def watch():
                nonlocal seen_waiting
                while True:
                    seen_waiting = max(seen_waiting, engine.model.num_waiting)
                    await asyncio.sleep(0.005)

            watcher = asyncio.create_task(watch())
            async with aiohttp.ClientSession() as s:

                async def one(i):
                    body = {"prompt": f"request {i} " + "x" * 570, "max_tokens": 80,
                            "ignore_eos": True}  # fmt: skip
                    async with s.post(engine.url + "/v1/completions", json=body) as resp:
                        assert resp.status == 200
                        return (await resp.json())["usage"]

                usages = await asyncio.gather(*(one(i) for i in range(6)))
                watcher.cancel()
                m = await scrape(s, engine.url)
            assert seen_waiting > 0
            assert m["vllm:num_preemptions_total"] > 0
            assert m["vllm:generation_tokens_total"] == sum(u["completion_tokens"] for u in usages)
            assert m["vllm:prompt_tokens_total"] == sum(u["prompt_tokens"] for u in usages)
            assert m["vllm:request_success_total{finished_reason=length}"] == 6
            assert m["vllm:time_to_first_token_seconds_count"] == 6
            assert m["vllm:e2e_request_latency_seconds_count"] == 6
            assert m["vllm:inter_token_latency_seconds_count"] == 6 * 79
            assert m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0
            assert m["vllm:kv_cache_usage_perc"] == 0
            assert m["vllm:prefix_cache_queries_total"] >= m["vllm:prompt_tokens_total"]

    arun(main())
