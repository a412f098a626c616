"""The controller's own scrapes of real emulated engines: windows, both vLLM name sets, staleness.

Two emulated engines on 127.0.0.1 (one exposing the current vLLM metric names, one the legacy
ones), driven with the official ``openai`` client. The scraper's clock is a test clock, so ages and
staleness need no waiting; the HTTP is real.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import numpy as np
import openai
import pytest

from controller.scrape import EngineScraper
from fastroute.config import EngineConfig
from fastroute.emulator.server import EmulatedFleet, EngineSpec

pytestmark = pytest.mark.integration


def run(coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


async def _requests(url: str, n: int, prompt: str = "hello there", max_tokens: int = 4) -> None:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
        for _ in range(n):
            await client.completions.create(model="demo-8b", prompt=prompt, max_tokens=max_tokens)


def test_scrapes_make_windows_from_both_metric_generations_and_mark_stale() -> None:
    """Requests between two scrapes appear as TTFT / inter-token observations and a completed
    rate over the (test-clock) interval, with current and legacy names alike; a stopped engine's
    scrapes fail, it turns stale after ``stale_after_s`` and contributes nothing."""

    async def main() -> None:
        specs = [
            EngineSpec(name="engine-0", model_name="demo-8b", profile="h100", port=0),
            EngineSpec(
                name="engine-1",
                model_name="demo-8b",
                profile="h100",
                port=0,
                metrics_compat="legacy",
            ),
        ]
        async with EmulatedFleet(specs) as fleet:
            engines = [
                EngineConfig(name=f"engine-{i}", url=u, models=("demo-8b",))
                for i, u in enumerate(fleet.urls)
            ]
            clock = Clock()
            scraper = EngineScraper(
                engines, interval_s=1.0, timeout_s=5.0, stale_after_s=3.0, clock=clock
            )
            try:
                await scraper.scrape_once()
                assert not scraper.stale().any()
                await asyncio.gather(_requests(fleet.urls[0], 3), _requests(fleet.urls[1], 5))
                clock.now += 2.0
                await scraper.scrape_once()
                win = scraper.drain()
                np.testing.assert_array_equal(win.ttft_count, [3, 5])
                assert np.all(win.tbot_count > 0) and np.all(win.ttft_sum_s > 0)
                np.testing.assert_allclose(win.load_rps, [1.5, 2.5])
                assert np.all(win.running == 0) and np.all(np.isfinite(win.kv_cache_usage))
                st = scraper.state(1)
                assert st["healthy"] is True and st["error"] is None and st["age_s"] == 0.0
                # the window was drained: nothing new
                await scraper.scrape_once()
                assert not scraper.drain().ttft_count.any()

                await fleet[1].stop()
                clock.now += 1.0
                await scraper.scrape_once()
                st = scraper.state(1)
                assert st["error"] is not None and st["errors_total"] == 1
                assert not st["stale"] and not scraper.stale()[1]  # age 1 s < 3 s
                clock.now += 3.0
                await _requests(fleet.urls[0], 1)
                await scraper.scrape_once()
                win = scraper.drain()
                np.testing.assert_array_equal(win.stale, [False, True])
                assert win.ttft_count[1] == 0 and np.isnan(win.load_rps[1])
                assert win.ttft_count[0] == 1
                assert scraper.state(1)["stale"] and scraper.state(1)["age_s"] == 4.0
            finally:
                await scraper.close()

    run(main())


def test_unreachable_engine_is_bounded_by_the_timeout() -> None:
    """A port that accepts nothing fails fast; a round never takes longer than the timeout."""

    async def main() -> None:
        engines = [EngineConfig(name="gone", url="http://127.0.0.1:9", models=("demo-8b",))]
        scraper = EngineScraper(engines, interval_s=1.0, timeout_s=0.5)
        try:
            await asyncio.wait_for(scraper.scrape_once(), 5.0)
        finally:
            await scraper.close()
        st = scraper.state(0)
        assert st["stale"] and st["age_s"] is None and st["errors_total"] == 1
        assert st["error"] and st["healthy"] is None

    run(main())


def test_prefix_cache_hit_rates_come_from_the_engines_counters() -> None:
    """Repeats of a long prompt hit the emulated engine's prefix cache: the engine's own
    counters (``vllm:prefix_cache_*``) windowed between two scrapes give its hit rate and the
    fleet's (token-weighted); the idle engine is "no traffic", not 0 %; a stopped one turns
    stale and leaves the fleet figure; the controller's gauges follow."""
    from prometheus_client import generate_latest

    from controller.metrics import ControllerMetrics

    async def main() -> None:
        specs = [
            EngineSpec(name=f"engine-{i}", model_name="demo-8b", profile="h100", port=0)
            for i in range(2)
        ]
        prompt = "tell me hello world " * 200  # many KV blocks, shared by every repeat
        async with EmulatedFleet(specs) as fleet:
            engines = [
                EngineConfig(name=f"engine-{i}", url=u, models=("demo-8b",))
                for i, u in enumerate(fleet.urls)
            ]
            clock = Clock()
            scraper = EngineScraper(
                engines, interval_s=1.0, timeout_s=5.0, stale_after_s=3.0, clock=clock
            )
            metrics = ControllerMetrics()
            names = [e.name for e in engines]
            try:
                await scraper.scrape_once()
                await _requests(fleet.urls[0], 4, prompt, max_tokens=2)
                clock.now += 2.0
                await scraper.scrape_once()
                model = fleet[0].model
                hits, queries = model.prefix_cache_hits_total, model.prefix_cache_queries_total
                assert hits > 0 and queries > hits
                r0, r1 = scraper.prefix_hit_rates()
                assert r0.status == "ok" and r0.source == "counters" and r0.window_s == 2.0
                assert (r0.hits_tokens, r0.queries_tokens) == (hits, queries)
                assert r0.rate == pytest.approx(hits / queries)
                assert r1.status == "no_traffic" and r1.rate is None
                assert scraper.state(0)["prefix_cache"]["rate"] == pytest.approx(hits / queries)
                metrics.record_scrapes(names, scraper, clock.now)
                text = generate_latest(metrics.registry).decode()
                ratio = "fastroute_controller_engine_prefix_cache_hit_ratio"
                assert f'{ratio}{{engine="engine-0"}} {hits / queries!r}' in text
                assert f'{ratio}{{engine="engine-1"}}' not in text  # idle: no ratio
                assert f"fastroute_controller_prefix_cache_hit_ratio {hits / queries!r}" in text

                await fleet[0].stop()
                clock.now += 4.0
                await scraper.scrape_once()
                r0, r1 = scraper.prefix_hit_rates()
                assert r0.status == "unknown" and r1.status == "no_traffic"  # stale: unknown
                metrics.record_scrapes(names, scraper, clock.now)
                text = generate_latest(metrics.registry).decode()
                assert f'{ratio}{{engine="engine-0"}}' not in text
                assert "fastroute_controller_prefix_cache_hit_ratio NaN" in text
            finally:
                await scraper.close()

    run(main())


def test_the_scraped_token_work_rates_the_reuse_gain() -> None:
    """Repeats of one long prompt on both engines of a peer group: the drained scrape window
    carries each engine's queried, cached and generated tokens (its own ``/metrics``
    counters), and the fleet model plans the group at ``capacity_rps`` × the gain of their
    sums; the controller exports the gain."""
    from prometheus_client import generate_latest

    from controller.learning import FleetLearning
    from controller.metrics import ControllerMetrics
    from controller.model import FleetModel
    from controller.options import ControllerOptions
    from controller.reuse import reuse_gain
    from fastroute.config import decode_config

    async def main() -> None:
        specs = [
            EngineSpec(name=f"engine-{i}", model_name="demo-8b", profile="h100", port=0)
            for i in range(2)
        ]
        prompt = "tell me hello world " * 200
        async with EmulatedFleet(specs) as fleet:
            toml = "".join(
                f'[[engines]]\nname = "engine-{i}"\nurl = "{u}"\nmodels = ["demo-8b"]\n'
                f'hardware = "h100"\ncapacity_rps = 10.0\n\n'
                for i, u in enumerate(fleet.urls)
            )
            config = decode_config(toml, source="test.toml")
            learning = FleetLearning(config, FleetModel.from_config(config), ControllerOptions())
            clock = Clock()
            scraper = EngineScraper(
                config.engines, interval_s=1.0, timeout_s=5.0, stale_after_s=3.0, clock=clock
            )
            try:
                await scraper.scrape_once()
                before = [e.model.generation_tokens_total for e in fleet]
                for url in fleet.urls:
                    await _requests(url, 4, prompt, max_tokens=8)
                clock.now += 2.0
                await scraper.scrape_once()
                window = scraper.drain(clock.now)
                generated = [
                    e.model.generation_tokens_total - b for e, b in zip(fleet, before, strict=True)
                ]
                assert [r.generated_tokens for r in window.prefix_hits] == generated
                q = sum(r.queries_tokens or 0.0 for r in window.prefix_hits)
                h = sum(r.hits_tokens or 0.0 for r in window.prefix_hits)
                expected = reuse_gain(q, h, sum(generated), max_gain=4.0)
                assert h > q / 2 and expected > 1.0  # 3 of 4 repeats hit the cache
                learning.close_window(clock.now, window)
                assert learning.reuse_gain.tolist() == [expected, expected]
                caps = learning.model.groups.engine_capacity_rps
                assert caps.tolist() == pytest.approx([10.0 * expected] * 2)
                metrics = ControllerMetrics()
                metrics.engine_reuse_gain.labels("engine-0").set(float(learning.reuse_gain[0]))
                text = generate_latest(metrics.registry).decode()
                assert (
                    f'fastroute_controller_engine_reuse_gain{{engine="engine-0"}} {expected!r}'
                    in text
                )
            finally:
                await scraper.close()

    run(main())
