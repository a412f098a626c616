"""The shared scrape machinery: rounds over real loopback HTTP servers, bounds, errors, results."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from fastroute.config import EngineConfig
from fastroute.signals import scrape
from fastroute.signals.scrape import EngineScrape, EngineScraper
from fastroute.signals.vllm import parse_vllm_metrics
from fastroute.testing.servers import serve_app
from fastroute.testing.waiting import wait_until

METRICS = (
    'vllm:num_requests_running{model_name="a"} 2\n'
    'vllm:num_requests_running{model_name="b"} 3\n'
    'vllm:num_requests_waiting{model_name="a"} 1\n'
)


def run(coro: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


@dataclass
class Engine:
    """One fake engine's behaviour and what it saw."""

    metrics_status: int = 200
    health_status: int = 200
    body: str = METRICS
    hold: asyncio.Event | None = None  # /metrics waits on it (an engine that hangs)
    paths: list[str] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)
    in_flight: int = 0
    peak: int = 0


@asynccontextmanager
async def serve(engine: Engine) -> AsyncIterator[str]:
    """A loopback HTTP server answering ``/metrics`` and ``/health`` as ``engine`` says."""

    async def metrics(request: web.Request) -> web.Response:
        engine.paths.append(request.path)
        engine.auth.append(request.headers.get("Authorization"))
        engine.in_flight += 1
        engine.peak = max(engine.peak, engine.in_flight)
        try:
            if engine.hold is not None:
                await engine.hold.wait()
            return web.Response(status=engine.metrics_status, text=engine.body)
        finally:
            engine.in_flight -= 1

    async def health(request: web.Request) -> web.Response:
        engine.paths.append(request.path)
        return web.Response(status=engine.health_status)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    async with serve_app(app, shutdown_timeout_s=0.1) as url:
        try:
            yield url
        finally:
            if engine.hold is not None:
                engine.hold.set()  # release hung requests before the server stops


def _engines(url: str, n: int = 1, api_key: str | None = None) -> list[EngineConfig]:
    return [EngineConfig(name=f"e{i}", url=url, models=("a",), api_key=api_key) for i in range(n)]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"interval_s": 0.0}, "interval_s > 0"),
        ({"timeout_s": -1.0}, "timeout_s > 0"),
        ({"max_concurrency": 0}, "max_concurrency >= 1"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineScraper(_engines("http://127.0.0.1:9"), **kwargs)


def test_duplicate_engine_names_are_refused() -> None:
    engines = [EngineConfig(name="e", url=f"http://127.0.0.1:{p}", models=("a",)) for p in (9, 10)]
    with pytest.raises(ValueError, match="unique"):
        EngineScraper(engines)


def test_absorb_merges_models_and_clears_the_error() -> None:
    result = EngineScrape("e0", error="timeout after 0.5 s")
    by_model = parse_vllm_metrics(METRICS, scraped_at_s=100.0)
    result.absorb(by_model)
    assert result.error is None and result.by_model == by_model
    assert result.signals is not None and result.signals.num_requests_running == 5.0
    assert result.age_s(103.0) == 3.0 and EngineScrape("e1").age_s(103.0) is None


@pytest.mark.integration
def test_a_round_fetches_metrics_and_health_and_stamps_the_clock() -> None:
    """``/metrics`` parsed per model and merged, ``/health`` read, the bearer token sent, the
    scrape stamped by the scraper's clock; without ``health`` only ``/metrics`` is asked."""

    async def main() -> None:
        engine = Engine(health_status=503)
        async with serve(engine) as url:
            scraper = EngineScraper(
                _engines(url, api_key="k"), health=True, timeout_s=5.0, clock=lambda: 42.0
            )
            try:
                await scraper.scrape_once()
            finally:
                await scraper.close()
            r = scraper.results["e0"]
            assert r.error is None and r.healthy is False and scraper.rounds_total == 1
            assert r.by_model is not None and sorted(r.by_model) == ["a", "b"]
            assert r.signals is not None and r.signals.num_requests_running == 5.0
            assert r.signals.scraped_at_s == 42.0 and r.signals.scrape_duration_s >= 0.0
            assert sorted(engine.paths) == ["/health", "/metrics"]
            assert set(engine.auth) == {"Bearer k"}

            engine.paths.clear()
            plain = EngineScraper(_engines(url), timeout_s=5.0)
            try:
                await plain.scrape_once()
            finally:
                await plain.close()
            assert engine.paths == ["/metrics"] and plain.results["e0"].healthy is None

    run(main())


@pytest.mark.integration
def test_failures_keep_the_last_good_signals_and_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """An HTTP error, an oversized body and an unparsable body each fail the scrape with a
    specific error; the last good signals stay and the counters add up."""

    async def main() -> None:
        engine = Engine()
        async with serve(engine) as url:
            scraper = EngineScraper(_engines(url), timeout_s=5.0)
            r = scraper.results["e0"]
            try:
                await scraper.scrape_once()
                good = r.signals
                assert good is not None and r.error is None

                engine.metrics_status = 500
                await scraper.scrape_once()
                assert r.error == "MetricsParseError: /metrics answered HTTP 500"

                engine.metrics_status = 200
                monkeypatch.setattr(scrape, "MAX_METRICS_BYTES", 16)
                await scraper.scrape_once()
                assert r.error == "MetricsParseError: /metrics is over 16 bytes"
                monkeypatch.undo()

                engine.body = "this is { not prometheus\n"
                await scraper.scrape_once()
                assert r.error is not None and r.error.startswith("MetricsParseError")
                assert r.signals is good and (r.scrapes_total, r.errors_total) == (4, 3)

                engine.body = METRICS
                await scraper.scrape_once()
                assert r.error is None and r.signals is not good
            finally:
                await scraper.close()

    run(main())


@pytest.mark.integration
def test_a_hanging_engine_times_out_and_the_round_still_ends() -> None:
    """An engine that never answers fails with a timeout; the other engine's scrape succeeds."""

    async def main() -> None:
        stuck, fine = Engine(hold=asyncio.Event()), Engine()
        async with serve(stuck) as stuck_url, serve(fine) as fine_url:
            engines = [
                EngineConfig(name="stuck", url=stuck_url, models=("a",)),
                EngineConfig(name="fine", url=fine_url, models=("a",)),
            ]
            scraper = EngineScraper(engines, timeout_s=0.2)
            try:
                await asyncio.wait_for(scraper.scrape_once(), 5.0)
            finally:
                await scraper.close()
            assert scraper.results["stuck"].error == "timeout after 0.2 s"
            assert scraper.results["stuck"].signals is None
            assert scraper.results["fine"].error is None
            assert scraper.results["fine"].signals is not None

    run(main())


@pytest.mark.integration
def test_at_most_max_concurrency_engines_are_scraped_at_once() -> None:
    """Four engines, ``max_concurrency=2``: two requests are held in flight, no third starts."""

    async def main() -> None:
        engine = Engine(hold=asyncio.Event())
        async with serve(engine) as url:
            scraper = EngineScraper(_engines(url, 4), max_concurrency=2, timeout_s=10.0)
            try:
                round_ = asyncio.create_task(scraper.scrape_once())
                await wait_until(lambda: engine.in_flight == 2)
                assert engine.hold is not None
                engine.hold.set()
                await asyncio.wait_for(round_, 5.0)
            finally:
                await scraper.close()
            assert engine.peak == 2 and len(engine.paths) == 4
            assert all(r.error is None for r in scraper.results.values())

    run(main())


@pytest.mark.integration
def test_run_repeats_rounds_until_cancelled_and_closes_the_session() -> None:
    async def main() -> None:
        engine = Engine()
        async with serve(engine) as url:
            scraper = EngineScraper(_engines(url), interval_s=0.05, timeout_s=5.0)
            task = asyncio.create_task(scraper.run())
            await wait_until(lambda: scraper.rounds_total >= 3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert scraper._session is None
            assert len(engine.paths) >= 3

    run(main())


@pytest.mark.integration
@pytest.mark.parametrize("status", [404, 501])
def test_metrics_turned_off_is_said_once_and_is_not_a_failure(
    status: int, caplog: pytest.LogCaptureFixture
) -> None:
    """``/metrics`` answering 404 or 501 means the engine's metrics are off: one warning naming
    the flag that turns them on, no error, no failure counted; a later good scrape clears it."""

    async def main() -> None:
        engine = Engine(metrics_status=status)
        async with serve(engine) as url:
            engines = [EngineConfig(name="e0", url=url, models=("a",), kind="sglang")]
            engine.body = 'sglang:num_running_reqs{model_name="a"} 4\n'
            scraper = EngineScraper(engines, timeout_s=5.0)
            r = scraper.results["e0"]
            try:
                with caplog.at_level("WARNING", logger="fastroute.signals.scrape"):
                    for _ in range(3):
                        await scraper.scrape_once()
                warnings = [m for m in caplog.messages if "metrics turned off" in m]
                assert len(warnings) == 1 and "--enable-metrics" in warnings[0]
                assert r.metrics_disabled and r.error is None and r.signals is None
                assert (r.scrapes_total, r.errors_total) == (3, 0)

                engine.metrics_status = 200
                await scraper.scrape_once()
                assert not r.metrics_disabled and r.signals is not None
                assert r.signals.num_requests_running == 4.0
            finally:
                await scraper.close()

    run(main())


@pytest.mark.integration
def test_a_page_without_the_kinds_metrics_is_no_signal() -> None:
    """A page with no metric of the engine's dialect (a vLLM page for an SGLang engine) keeps the
    signals as they were (None: never an empty signal stamped at time 0) and is an error."""

    async def main() -> None:
        engine = Engine()  # serves vLLM names
        async with serve(engine) as url:
            engines = [EngineConfig(name="e0", url=url, models=("a",), kind="sglang")]
            scraper = EngineScraper(engines, timeout_s=5.0)
            r = scraper.results["e0"]
            try:
                await scraper.scrape_once()
            finally:
                await scraper.close()
            assert r.signals is None and r.by_model is None and r.age_s() is None
            assert r.error == (
                "MetricsParseError: /metrics has no sglang metric (is engines[].kind right?)"
            )
            assert r.errors_total == 1

    run(main())


@pytest.mark.integration
def test_an_openai_engine_is_not_scraped_for_metrics() -> None:
    """An ``openai``-kind engine has no metrics to read: only ``/health`` is asked (when asked),
    no error, no signals."""

    async def main() -> None:
        engine = Engine()
        async with serve(engine) as url:
            engines = [EngineConfig(name="e0", url=url, models=("a",), kind="openai")]
            for health in (False, True):
                scraper = EngineScraper(engines, timeout_s=5.0, health=health)
                try:
                    await scraper.scrape_once()
                finally:
                    await scraper.close()
                r = scraper.results["e0"]
                assert r.error is None and r.signals is None and r.errors_total == 0
            assert engine.paths == ["/health"]
            assert r.healthy is True

    run(main())
