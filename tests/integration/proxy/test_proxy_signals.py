"""The signal path on loopback: weights puller, reporter and engine scraper.

A tiny aiohttp stub plays the controller (long-poll ``GET /v1/table``, ``POST
/v1/reports``); engines are the emulator; the proxy is a ``ProxyApp`` (served by
the lean server) plus the signal tasks it installs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from proxy_harness import MODEL, SHORT_OUTPUTS, Harness, config_toml, wait_until

from fastroute.config import decode_config
from fastroute.emulator.server import EmulatedFleet, fleet_specs
from fastroute.hashing import engine_id
from fastroute.proxy.background.puller import WeightsPuller
from fastroute.proxy.background.reporter import Reporter
from fastroute.proxy.path.fleet import class_key
from fastroute.proxy.proxy_app import ProxyApp
from fastroute.signals.reports import DemandAggregator, Report, decode_report
from fastroute.tables import TableReader, TableSnapshot, TableWriter
from fastroute.tables.wire import encode_snapshot
from fastroute.testing.processes import free_port
from fastroute.testing.servers import serve_proxy_app

pytestmark = pytest.mark.integration


class StubController:
    """Serves snapshots with the long-poll contract and records reports."""

    def __init__(self) -> None:
        self.snapshot: TableSnapshot | None = None
        self.changed = asyncio.Event()
        self.fail_next = 0
        self.garbage_next = 0
        self.polls: list[tuple[float, int]] = []  # (monotonic time, after)
        self.reports: list[Report] = []
        self.report_content_types: list[str] = []
        self.report_status = 200
        self.runner: web.AppRunner | None = None
        self.url = ""

    def publish(self, snap: TableSnapshot) -> None:
        self.snapshot = snap
        self.changed.set()
        self.changed = asyncio.Event()

    async def table(self, request: web.Request) -> web.StreamResponse:
        after = int(request.query.get("after", "0"))
        timeout_s = float(request.query.get("timeout_s", "30"))
        self.polls.append((time.monotonic(), after))
        if self.fail_next:
            self.fail_next -= 1
            return web.Response(status=500)
        if self.garbage_next:
            self.garbage_next -= 1
            return web.Response(body=b"\x92\x01\x02", content_type="application/msgpack")
        epoch = request.query.get("epoch")  # like the controller: another epoch answers at once
        if self._same(after, epoch):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), timeout_s)
        snap = self.snapshot
        if snap is None or self._same(after, epoch):
            return web.Response(status=304)
        fmt = "json" if "json" in request.headers.get("Accept", "") else "msgpack"
        return web.Response(
            body=encode_snapshot(snap, fmt),
            content_type=f"application/{fmt}",
            headers={"x-fastroute-generation": str(snap.generation)},
        )

    def _same(self, after: int, epoch: str | None) -> bool:
        snap = self.snapshot
        if snap is None:
            return True
        return snap.generation == after and epoch in (None, str(snap.meta.get("epoch")))

    async def post_report(self, request: web.Request) -> web.Response:
        self.report_content_types.append(request.content_type)
        if self.report_status != 200:
            return web.Response(status=self.report_status)
        self.reports.append(decode_report(await request.read()))
        return web.Response(status=204)

    async def start(self) -> StubController:
        app = web.Application()
        app.router.add_get("/v1/table", self.table)
        app.router.add_post("/v1/reports", self.post_report)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


def _snap(generation: int, weights: list[list[float]], ids: list[int] | None = None, **kw: Any):
    ids = ids if ids is not None else [engine_id(f"engine-{i}") for i in range(len(weights[0]))]
    return TableSnapshot.validated(
        generation, ids, np.array(weights), published_at=time.time(), **kw
    )


def _local(name: str) -> TableSnapshot | None:
    try:
        reader = TableReader(name)
    except FileNotFoundError:
        return None
    try:
        return reader.snapshot() if reader.generation() else None
    finally:
        reader.close()


def _equal(local: TableSnapshot | None, served: TableSnapshot) -> bool:
    if local is None:
        return False
    return (
        np.array_equal(local.engine_ids, served.engine_ids)
        and np.array_equal(local.class_keys, served.class_keys)
        and np.array_equal(local.weights, served.weights)
        and np.array_equal(local.engine_flags, served.engine_flags)
        and np.array_equal(local.shed_fraction, served.shed_fraction)
        and local.retry_ratio == served.retry_ratio
        and local.meta == served.meta
    )


@contextlib.asynccontextmanager
async def _running(coro: Any) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(coro)
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _puller(stub: StubController, name: str, **kw: Any) -> WeightsPuller:
    kw = {"poll_timeout_s": 2.0, "backoff_initial_s": 0.05, "backoff_max_s": 0.4, **kw}
    return WeightsPuller(stub.url, name, **kw)


def test_puller_long_polls_and_mirrors_the_served_table(h: Harness, shm_name: str) -> None:
    """The local table ends up equal to each served snapshot; polls wait instead of spinning."""

    async def main() -> None:
        stub = await StubController().start()
        try:
            first = _snap(1, [[1.0, 2.0], [0.0, 5.0]], meta={"plan": "a"})
            stub.publish(first)
            puller = _puller(stub, shm_name)
            async with _running(puller.run()):
                await wait_until(lambda: _equal(_local(shm_name), first))
                await wait_until(lambda: len(stub.polls) >= 2)  # now parked in a long-poll
                second = _snap(7, [[3.0, 0.0, 1.0]], shed_fraction=[0.25], retry_ratio=0.05)
                t0 = time.monotonic()
                stub.publish(second)
                # The table is written in a thread and the generation recorded after it
                # returns: wait for both (the table alone raced the attribute under load).
                await wait_until(
                    lambda: _equal(_local(shm_name), second) and puller.controller_generation == 7
                )
                assert time.monotonic() - t0 < 1.0  # woken by the long-poll, not a poll period
                assert puller.active
                assert [after for _, after in stub.polls[:3]] == [0, 1, 7][: len(stub.polls[:3])]
            assert len(stub.polls) <= 5, stub.polls
            assert puller.errors_total == {}
        finally:
            await stub.stop()

    h.run(main())


def test_puller_fences_a_deposed_leaders_table(h: Harness, shm_name: str) -> None:
    """A table of an older epoch than the one applied (a deposed leader's, pushed after the new
    one) is counted and refused, the local table unchanged; a newer epoch's table is applied even
    though its generations restart low; a table without an epoch is never fenced."""

    async def main() -> None:
        stub = await StubController().start()
        try:
            puller = _puller(stub, shm_name)
            new_leader = _snap(4, [[1.0, 2.0]], meta={"epoch": 50})
            stub.publish(new_leader)
            async with _running(puller.run()):
                # the table lands (worker thread) a moment before the puller notes its epoch
                await wait_until(lambda: puller.epoch == 50)
                assert _equal(_local(shm_name), new_leader)
                stub.publish(_snap(9, [[7.0, 7.0]], meta={"epoch": 41}))  # the deposed leader
                await wait_until(lambda: puller.fenced_total == 1)
                assert _equal(_local(shm_name), new_leader)
                assert puller.epoch == 50 and puller.controller_generation == 4
                successor = _snap(1, [[0.0, 3.0]], meta={"epoch": 77})  # generations restart
                stub.publish(successor)
                await wait_until(lambda: puller.epoch == 77)
                assert _equal(_local(shm_name), successor)
                assert puller.errors_total.get("fenced", 0) >= 1
                fenced = puller.fenced_total  # the stale table may be refused once per backoff
                single = _snap(2, [[5.0, 5.0]])  # back to one controller without an election
                stub.publish(single)
                await wait_until(lambda: puller.epoch is None)
                assert _equal(_local(shm_name), single) and puller.fenced_total == fenced
        finally:
            await stub.stop()

    h.run(main())


def test_puller_tries_the_fallback_controllers_in_turn(h: Harness, shm_name: str) -> None:
    """A dead first controller: the puller moves on to the next URL and applies its table."""

    async def main() -> None:
        stub = await StubController().start()
        try:
            table = _snap(3, [[2.0, 1.0]], meta={"epoch": 5})
            stub.publish(table)
            dead = f"http://127.0.0.1:{free_port()}"
            puller = WeightsPuller(
                dead, shm_name, poll_timeout_s=2.0, backoff_initial_s=0.05,
                fallback_urls=(stub.url,),
            )  # fmt: skip
            async with _running(puller.run()):
                await wait_until(lambda: puller.epoch == 5)
                assert _equal(_local(shm_name), table)
                assert puller.errors_total.get("connect", 0) >= 1
                assert puller.url == stub.url + "/v1/table"
        finally:
            await stub.stop()

    h.run(main())


def test_puller_backs_off_on_errors_and_keeps_the_last_table(h: Harness, shm_name: str) -> None:
    """5xx and bad payloads back off exponentially; a dead controller leaves the table as it was."""

    async def main() -> None:
        stub = await StubController().start()
        try:
            stub.fail_next = 3
            stub.publish(_snap(1, [[1.0, 1.0]]))
            puller = _puller(stub, shm_name, rng=lambda: 1.0)  # no jitter: exact delays
            async with _running(puller.run()):
                await wait_until(lambda: puller.controller_generation == 1)
                times = [t for t, _ in stub.polls[:4]]
                gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
                for gap, expected in zip(gaps, (0.05, 0.1, 0.2), strict=True):
                    assert gap >= expected * 0.9, gaps
                assert puller.errors_total == {"http": 3}
                kept = _local(shm_name)
                assert kept is not None
                stub.garbage_next = 1
                stub.publish(_snap(2, [[9.0, 9.0]]))
                await wait_until(lambda: puller.errors_total.get("decode", 0) == 1)
                await wait_until(lambda: puller.controller_generation == 2)
                served = stub.snapshot
                assert served is not None
                await stub.stop()  # controller down
                await wait_until(lambda: puller.errors_total.get("connect", 0) >= 2)
                assert _equal(_local(shm_name), served)
                assert puller.last_error is not None and puller.last_error.startswith("connect")
        finally:
            await stub.stop()

    h.run(main())


def test_second_puller_stands_by_while_the_lock_is_taken(h: Harness, shm_name: str) -> None:
    """With the table's writer lock held elsewhere the puller does not poll; it takes over later."""

    async def main() -> None:
        stub = await StubController().start()
        holder = TableWriter(shm_name, max_engines=8, max_classes=8)
        try:
            stub.publish(_snap(3, [[1.0, 4.0]]))
            puller = _puller(stub, shm_name, lock_retry_s=0.05)
            async with _running(puller.run()):
                await wait_until(lambda: puller.last_error == "standby")
                assert not puller.active and stub.polls == []
                holder.close()
                await wait_until(lambda: _equal(_local(shm_name), stub.snapshot))  # type: ignore[arg-type]
                assert puller.active
        finally:
            holder.close()
            await stub.stop()

    h.run(main())


def test_reporter_drops_refused_reports(h: Harness) -> None:
    """A refused report is dropped, not re-sent; the next one carries only its own window."""

    async def main() -> None:
        stub = await StubController().start()
        try:
            agg = DemandAggregator("local", "w-1")
            reporter = Reporter(stub.url, agg, interval_s=0.2)
            agg.observe_request(5, 10)
            stub.report_status = 503
            assert not await reporter.report_once()
            stub.report_status = 200
            agg.observe_request(5, 20)
            agg.observe_request(5, 30)
            assert await reporter.report_once()
            assert (reporter.sent_total, reporter.failed_total) == (1, 1)
            (report,) = stub.reports
            assert report.classes[0].requests == 2 and report.classes[0].prompt_tokens == 50
            assert stub.report_content_types == ["application/msgpack"] * 2
            await stub.stop()
            t0 = time.monotonic()
            assert not await reporter.report_once()  # controller down: bounded, dropped
            assert time.monotonic() - t0 < 1.0
            await reporter.close()
        finally:
            await stub.stop()

    h.run(main())


@contextlib.asynccontextmanager
async def _signal_stack(
    n_engines: int, extra: str, table_name: str | None = None, compat: str = "current"
) -> AsyncIterator[tuple[EmulatedFleet, ProxyApp, str]]:
    specs = fleet_specs(
        n_engines,
        model_name=MODEL,
        profile="h100",
        output_lengths=SHORT_OUTPUTS,
        metrics_compat=compat,
    )
    async with EmulatedFleet(specs) as fleet:
        config = decode_config(
            config_toml(fleet.urls, table_name=table_name).replace(
                "\n[proxy]\n", "\n[proxy]\n" + extra
            ),
            source="test.toml",
        )
        app = ProxyApp(config)  # installs the signal tasks the config asks for
        async with serve_proxy_app(app, drain_timeout_s=2.0) as (url, _):
            yield fleet, app, url


def test_proxy_follows_the_controller_and_reports_demand(h: Harness, shm_name: str) -> None:
    """Pulled weights steer routing; reports carry the class's requests and engine latencies."""

    async def main() -> None:
        stub = await StubController().start()
        try:
            key = class_key("local", MODEL, "default")
            stub.publish(
                _snap(4, [[0.0, 1.0]], class_keys=[key])  # everything on engine-1
            )
            extra = f'controller_url = "{stub.url}"\nreport_interval_s = 0.2\n'
            async with (
                _signal_stack(2, extra, table_name=shm_name) as (_, app, url),
                aiohttp.ClientSession() as s,
            ):
                ctx = app.context
                assert ctx.aggregator is not None
                await wait_until(lambda: ctx.fleet.state.generation > 0)
                engines = []
                for i in range(8):
                    body = h.chat_body(f"question {i}", stream=i < 3)
                    async with s.post(url + "/v1/chat/completions", json=body) as resp:
                        assert resp.status == 200, await resp.text()
                        await resp.read()
                        engines.append(resp.headers["x-fastroute-engine"])
                assert set(engines) == {"engine-1"}

                def totals() -> tuple[int, int, int, int, int]:
                    req = pt = out = att = ttft = 0
                    for r in stub.reports:
                        for c in r.classes:
                            if c.class_key == key:
                                req, pt, out = (
                                    req + c.requests,
                                    pt + c.prompt_tokens,
                                    out + c.output_tokens,
                                )
                        for e in r.engines:
                            if e.engine_id == engine_id("engine-1"):
                                att += e.attempts
                                ttft += e.ttft.count if e.ttft else 0
                    return req, pt, out, att, ttft

                await wait_until(lambda: totals()[0] == 8 and totals()[3] == 8)
                req, pt, out, att, ttft = totals()
                assert pt > 8 and out >= 8 and ttft == 3
                last = stub.reports[-1]
                assert last.source_cluster == "local" and last.worker_id
                ids = {e.engine_id for e in last.engines}
                assert ids == {engine_id("engine-0"), engine_id("engine-1")}  # state every window
                assert app.signals.puller is not None and app.signals.puller.active
                async with s.get(url + "/metrics") as resp:
                    text = await resp.text()
                assert "fastroute_proxy_weights_updates_total 1.0" in text
                assert 'fastroute_proxy_reports_total{outcome="sent"}' in text
        finally:
            await stub.stop()

    h.run(main())


def test_slow_engine_metrics_never_delay_routing(h: Harness) -> None:
    """An engine whose /metrics hangs 5 s times out in the scraper; requests stay fast."""

    async def main() -> None:
        extra = "scrape_engines = true\nscrape_interval_s = 0.2\nscrape_timeout_s = 0.15\n"
        async with (
            _signal_stack(2, extra, compat="legacy") as (fleet, app, url),
            aiohttp.ClientSession() as s,
        ):
            fleet[0].faults.apply({"metrics_delay_s": 5.0})
            scraper = app.signals.scraper
            assert scraper is not None
            slow, fast = scraper.results["engine-0"], scraper.results["engine-1"]
            await wait_until(lambda: slow.errors_total >= 2 and fast.signals is not None)
            assert slow.error is not None and "timeout" in slow.error
            latencies, engines = [], set()
            for i in range(20):
                t0 = time.monotonic()
                async with s.post(
                    url + "/v1/chat/completions", json=h.chat_body(f"q {i}", stream=i % 2 == 0)
                ) as resp:
                    assert resp.status == 200
                    await resp.read()
                    engines.add(resp.headers["x-fastroute-engine"])
                latencies.append(time.monotonic() - t0)
            assert engines == {"engine-0", "engine-1"}
            assert max(latencies) < 1.0, latencies  # far below the 5 s /metrics delay
            rounds = scraper.rounds_total
            await wait_until(lambda: scraper.rounds_total >= rounds + 2)
            s1 = fast.signals
            assert s1 is not None and s1.kv_cache_usage is not None  # legacy gpu_cache name
            assert s1.itl_s is not None and s1.itl_s.count > 0  # legacy time_per_output_token
            assert fast.error is None and (fast.age_s() or 0.0) < 1.0
            async with s.get(url + "/metrics") as resp:
                text = await resp.text()
            assert 'fastroute_proxy_engine_scrape_errors_total{engine="engine-0"}' in text
            assert 'fastroute_proxy_engine_requests_running{engine="engine-1"}' in text

    h.run(main(), timeout=20)
