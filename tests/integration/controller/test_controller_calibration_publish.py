"""Calibration published by the controller: proxies report it, new workers start from it.

The controller app runs in-process on 127.0.0.1 (``run_loop=False``); reports go over HTTP
from the proxy's :class:`~fastroute.proxy.background.reporter.Reporter`, and a fresh worker
loads the published state with
:class:`~fastroute.proxy.background.calibration_pull.CalibrationPull`, alone and wired
into a real proxy app whose classes use ``marginal-cost``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import aiohttp
import msgspec
import pytest
from controller_fleet import FAKE_URLS, two_region_toml

from controller.app import SERVICE, make_app
from controller.service import ControllerService
from fastroute.config import decode_config
from fastroute.predict import CalibrationSnapshot, FleetCalibration
from fastroute.proxy.background.calibration_pull import CalibrationPull
from fastroute.proxy.background.reporter import Reporter
from fastroute.proxy.proxy_app import ProxyApp
from fastroute.signals.reports import DemandAggregator
from fastroute.testing.servers import serve_app, serve_proxy_app
from fastroute.testing.waiting import wait_until

pytestmark = pytest.mark.integration

TYPE = "h100"  # the test fleet's hardware


def run(coro: Coroutine[Any, Any, Any], timeout: float = 25.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


@contextlib.asynccontextmanager
async def controller(table_name: str) -> AsyncIterator[tuple[ControllerService, str]]:
    config = decode_config(two_region_toml(table_name), "controller.toml")
    app = make_app(config, run_loop=False)
    async with serve_app(app) as url:
        yield app[SERVICE], url


def learned(n: int, *, calibrate: bool = True) -> FleetCalibration:
    """A worker's calibration after ``n`` prefills and ``n`` decode steps 1.4x the datasheet."""
    cal = FleetCalibration(calibrate=calibrate)
    nominal = cal.nominal(TYPE)
    for i in range(n):
        tokens = 100 + 37 * i
        cal.observe_prefill(TYPE, 1, tokens, 0, 1.4 * (nominal.a0_s + nominal.a1_s * tokens))
        batch, ctx = 4 + i % 16, (4 + i % 16) * (300 + 11 * i)
        took = 1.4 * (nominal.b0_s + nominal.b1_s * batch + nominal.b2_s * ctx)
        cal.observe_decode(TYPE, 1, batch, ctx, took)
    return cal


def test_reports_carry_new_calibration_and_a_fresh_worker_loads_it(shm_name: str) -> None:
    async def main() -> None:
        async with controller(shm_name) as (svc, url), aiohttp.ClientSession() as http:
            fresh = FleetCalibration()
            early = CalibrationPull(url, lambda: fresh, attempts=2, interval_s=0.01)
            await early.run()
            assert early.outcome == "none_published" and fresh.samples_total() == 0

            worker = learned(60)
            reporter = Reporter(url, DemandAggregator("east", "w-1"), calibration=lambda: worker)
            assert await reporter.report_once()
            published = svc.calibration.published()
            assert published is not None
            assert published.types[TYPE].n_samples == worker.samples_total() == 120
            # nothing new: the next report carries none, the board keeps the state
            assert await reporter.report_once()
            assert svc.calibration.published() is published
            worker.observe_prefill(TYPE, 1, 500, 0, 0.05)
            assert await reporter.report_once()
            assert svc.calibration.published().types[TYPE].n_samples == 121

            async with http.get(url + "/v1/calibration?format=json") as resp:
                assert resp.status == 200 and resp.content_type == "application/json"
                as_json = msgspec.json.decode(await resp.read(), type=CalibrationSnapshot)
            assert as_json.types[TYPE].coef == worker.model(TYPE).state().coef

            pull = CalibrationPull(url, lambda: fresh, attempts=1)
            await pull.run()
            assert pull.outcome == "loaded"
            assert fresh.model(TYPE).state().coef == worker.model(TYPE).state().coef
            nominal_b0 = FleetCalibration().nominal(TYPE).b0_s
            assert fresh.model(TYPE).state().coef["b0_s"] > 1.2 * nominal_b0

            again = CalibrationPull(url, lambda: fresh, attempts=1)
            await again.run()
            assert again.outcome == "not_needed"  # it has samples of its own now

    run(main())


def test_an_uncalibrated_worker_neither_publishes_nor_loads(shm_name: str) -> None:
    async def main() -> None:
        async with controller(shm_name) as (svc, url):
            frozen = learned(30, calibrate=False)
            reporter = Reporter(url, DemandAggregator("east", "w-1"), calibration=lambda: frozen)
            assert await reporter.report_once()
            assert svc.calibration.published() is None
            pull = CalibrationPull(url, lambda: FleetCalibration(calibrate=False), attempts=1)
            await pull.run()
            assert pull.outcome == "not_needed"
            async with aiohttp.ClientSession() as http:
                async with http.get(url + "/v1/calibration") as resp:
                    assert resp.status == 404

    run(main())


def test_a_marginal_cost_proxy_starts_from_the_published_calibration(
    shm_name: str, proxy_table: str
) -> None:
    """A proxy app with ``controller_url`` and a marginal-cost default policy loads the
    controller's calibration at start and shows it in /metrics."""

    async def main() -> None:
        async with controller(shm_name) as (svc, url):
            worker = learned(60)
            reporter = Reporter(url, DemandAggregator("east", "w-0"), calibration=lambda: worker)
            assert await reporter.report_once()
            extra = f'controller_url = "{url}"\nreport_interval_s = 0.2\n'
            text = two_region_toml(proxy_table, urls=FAKE_URLS, proxy=extra)
            text += '[policy]\ndefault = "marginal-cost"\n'
            papp = ProxyApp(decode_config(text, "proxy.toml"))
            async with serve_proxy_app(papp) as (purl, _), aiohttp.ClientSession() as http:
                pull = papp.signals.calibration
                assert pull is not None
                await wait_until(lambda: pull.outcome != "pending", timeout=10.0)
                assert pull.outcome == "loaded"
                cal = papp.context.metrics.calibration
                assert cal.model(TYPE).state().coef == worker.model(TYPE).state().coef
                async with http.get(purl + "/metrics") as resp:
                    text = await resp.text()
                assert 'fastroute_proxy_calibration_start{outcome="loaded"} 1.0' in text

    run(main())
