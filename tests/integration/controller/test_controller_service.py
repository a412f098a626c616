"""The controller service on loopback: control loop, table, long-poll, reports, plan, CLI.

The controller app runs in-process (``web.AppRunner`` on 127.0.0.1:0) over a config of engines
in two regions (east: engine-0, engine-1; west: engine-2, engine-3; RTT 80 ms). Where a proxy is
needed, the engines are the emulator (``EmulatedFleet``) and the proxy is
``fastroute.proxy.proxy_app.ProxyApp`` with ``controller_url`` set.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np
import pytest
from aiohttp import web
from controller_fleet import FAKE_URLS, MODEL, REGIONS, two_region_toml

from controller.app import API, SERVICE, make_app
from controller.service import ControllerService
from fastroute.config import PRIORITIES, decode_config
from fastroute.emulator.model import OutputLengthDistribution
from fastroute.emulator.server import EmulatedFleet, fleet_specs
from fastroute.proxy.path.fleet import class_key
from fastroute.proxy.proxy_app import ProxyApp
from fastroute.signals.reports import ClassDemand, Report, encode_report
from fastroute.tables import TableReader, TableSnapshot
from fastroute.tables.segment import shm_dir
from fastroute.tables.wire import decode_snapshot
from fastroute.testing.processes import free_port, http_get
from fastroute.testing.servers import serve_app, serve_proxy_app
from fastroute.testing.waiting import poll_until, wait_until

pytestmark = pytest.mark.integration

SHORT_OUTPUTS = OutputLengthDistribution(mu=1.4, sigma=0.2)
ROOT = Path(__file__).resolve().parents[3]


def run(coro: Coroutine[Any, Any, Any], timeout: float = 20.0) -> Any:
    """Run ``coro`` on a fresh loop under a hard timeout."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


TIMEOUTS = "[timeouts]\nconnect_timeout_s = 1.0\nfirst_byte_timeout_s = 5.0\n"


def config_toml(urls: list[str], table_name: str, *, proxy: str = "", port: int = 0) -> str:
    return two_region_toml(
        table_name,
        urls=urls,
        port=port,
        controller="long_poll_timeout_s = 2.0\n",
        proxy=proxy,
        tables=TIMEOUTS,
    )


@contextlib.asynccontextmanager
async def controller(
    table_name: str, urls: list[str] = FAKE_URLS, **kw: Any
) -> AsyncIterator[tuple[ControllerService, str, web.Application]]:
    config = decode_config(config_toml(urls, table_name), source="controller.toml")
    app = make_app(config, **kw)
    async with serve_app(app) as url:
        yield app[SERVICE], url, app


def _local(name: str) -> TableSnapshot:
    reader = TableReader(name)
    try:
        return reader.snapshot()
    finally:
        reader.close()


def _keys() -> set[int]:
    return {class_key(r, MODEL, p) for r in REGIONS for p in PRIORITIES}


def _report(requests: int, *, worker: str = "w-1", window_s: float = 1.0) -> bytes:
    now = time.time()
    classes = [ClassDemand(class_key=class_key("east", MODEL, "default"), requests=requests)]
    return encode_report(Report(1, "east", worker, now - window_s, now, classes, []))


def test_loop_publishes_rows_keyed_by_class_key(shm_name: str) -> None:
    """The table advances, holds one row per (cluster, model, priority) key, rows sum to 1."""

    async def main() -> None:
        async with controller(shm_name) as (svc, url, _), aiohttp.ClientSession() as s:
            await wait_until(lambda: svc.periods_total >= 3)
            snap = _local(shm_name)
            assert snap.generation >= 1 and snap.generation == svc.generation
            assert set(snap.class_keys.tolist()) == _keys() and snap.n_classes == 6
            np.testing.assert_allclose(snap.weights.sum(axis=1), 1.0)
            assert not snap.shed_fraction.any() and snap.retry_ratio == pytest.approx(0.1)
            assert snap.meta["status"] == "Optimal" and snap.meta["plan_id"] >= 1
            assert {"objective", "solve_time_s"} <= set(snap.meta)
            # low default demand: east rows stay on east engines (nearest, same load)
            east = snap.weights[snap.row(class_key("east", MODEL, "default"))]
            assert east[2:].sum() == 0.0 and east[:2].sum() == pytest.approx(1.0)
            async with s.get(url + "/health") as resp:
                assert resp.status == 200 and (await resp.json())["status"] == "ok"
        # closed without unlinking: proxies on this host keep the last table
        assert (shm_dir() / shm_name).exists()

    run(main())


def test_long_poll_answers_at_once_or_304_after_the_timeout(shm_name: str) -> None:
    """A differing generation answers at once; the current one waits ``timeout_s`` then 304."""

    async def main() -> None:
        async with controller(shm_name, max_waiters=2) as (svc, url, app):
            async with aiohttp.ClientSession() as s:
                await wait_until(lambda: svc.generation >= 1)
                await wait_until(lambda: svc.periods_total >= 3)  # steady: no new generations
                gen = svc.generation
                t0 = time.monotonic()
                async with s.get(url + "/v1/table", params={"after": "0"}) as resp:
                    assert resp.status == 200 and resp.content_type == "application/msgpack"
                    assert resp.headers["x-fastroute-generation"] == str(gen)
                    snap = decode_snapshot(await resp.read())
                assert time.monotonic() - t0 < 0.5
                assert snap.generation == gen and set(snap.class_keys.tolist()) == _keys()
                q = {"after": str(gen + 5), "format": "json"}
                async with s.get(url + "/v1/table", params=q) as resp:
                    assert resp.status == 200 and resp.content_type == "application/json"
                    assert json.loads(await resp.read())["generation"] == gen
                t0 = time.monotonic()
                q = {"after": str(gen), "timeout_s": "0.6"}
                async with s.get(url + "/v1/table", params=q) as resp:
                    assert resp.status == 304
                assert 0.55 <= time.monotonic() - t0 < 1.5
                assert svc.generation == gen
                # parked polls are bounded; a new generation wakes them
                parked = [asyncio.create_task(s.get(url + "/v1/table", params=q)) for _ in range(2)]
                await wait_until(lambda: app[API].waiters == 2)
                async with s.get(url + "/v1/table", params=q) as resp:
                    assert resp.status == 503 and resp.headers["Retry-After"] == "1"
                async with s.post(url + "/v1/reports", data=_report(1000)) as resp:
                    assert resp.status == 204
                for resp in await asyncio.gather(*parked):  # woken by the overload plan
                    assert resp.status == 200
                    assert int(resp.headers["x-fastroute-generation"]) > gen
                    resp.release()
                async with s.get(url + "/v1/table", params={"after": "x"}) as resp:
                    assert resp.status == 400

    run(main())


def test_overload_sheds_and_reports_are_validated(shm_name: str) -> None:
    """Reported demand above capacity → shed fraction > 0, lower retry ratio; bad reports → 400."""

    async def main() -> None:
        async with controller(shm_name) as (svc, url, _), aiohttp.ClientSession() as s:
            await wait_until(lambda: svc.generation >= 1)
            for body in (b"\x93\x01garbage", b"not msgpack at all", _report(1)[:-3]):
                async with s.post(url + "/v1/reports", data=body) as resp:
                    assert resp.status == 400
                    assert "bad report" in await resp.text()
            fields = msgspec.msgpack.decode(_report(5))
            bad_version = msgspec.msgpack.encode([7, *fields[1:]])
            async with s.post(url + "/v1/reports", data=bad_version) as resp:
                assert resp.status == 400 and "version" in await resp.text()
            key = class_key("east", MODEL, "default")

            def shed() -> float:
                snap = _local(shm_name)
                return float(snap.shed_fraction[snap.row(key)])

            for _ in range(3):  # 1000 req/s reported for east/default; capacity is 4 × 10
                async with s.post(url + "/v1/reports", data=_report(1000)) as resp:
                    assert resp.status == 204
                await asyncio.sleep(0.1)
            await wait_until(lambda: shed() > 0.9)
            snap = _local(shm_name)
            assert snap.retry_ratio == pytest.approx(0.02)  # 0.1 × 0.2 while shedding
            sums = snap.weights.sum(axis=1)
            full = snap.shed_fraction == 1.0  # batch goes first: fully shed rows are all zero
            np.testing.assert_allclose(sums[~full], 1.0)
            assert full.any() and not sums[full].any()
            async with s.get(url + "/v1/plan") as resp:
                assert resp.status == 200
                plan = await resp.json()
            assert plan["solve"]["status"] == "Optimal" and plan["solve"]["iterations"] >= 0
            assert plan["solve"]["solve_time_s"] >= 0 and plan["live_workers"] == 1
            assert [e["capacity_rps"] for e in plan["engines"]] == [10.0] * 4
            assert sum(e["load_rps"] for e in plan["engines"]) <= 0.95 * 40 + 1e-6
            by_name = {c["name"]: c for c in plan["classes"]}
            c = by_name[f"east/{MODEL}/default"]
            assert c["measured"] and c["demand_rps"] == pytest.approx(1000.0, rel=1e-6)
            assert c["shed_fraction"] > 0.9 and c["marginal_cost_s"] > 0
            assert set(c["allocation_rps"]) <= {f"engine-{i}" for i in range(4)}
            assert by_name[f"west/{MODEL}/default"]["measured"] is False
            async with s.get(url + "/metrics") as resp:
                text = await resp.text()
            assert 'fastroute_controller_reports_total{outcome="rejected"} 4.0' in text
            assert 'fastroute_controller_solves_total{status="Optimal"}' in text
            assert "fastroute_controller_solve_seconds_count" in text
            assert "fastroute_controller_table_generation" in text
            line = f'fastroute_controller_shed_fraction{{class="east/{MODEL}/default"}}'
            assert line in text

    run(main())


def test_proxy_pulls_routes_per_plan_and_its_reports_drive_demand(
    shm_name: str, proxy_table: str
) -> None:
    """A proxy with ``controller_url`` pulls the table, routes east, and its reports count; the
    controller's own scrapes of the engines are fresh and shown per engine."""

    async def main() -> None:
        specs = fleet_specs(4, model_name=MODEL, profile="h100", output_lengths=SHORT_OUTPUTS)
        async with (
            EmulatedFleet(specs) as fleet,
            controller(shm_name, fleet.urls) as (svc, curl, _),
            aiohttp.ClientSession() as s,
        ):
            extra = f'controller_url = "{curl}"\nreport_interval_s = 0.2\n'
            pconfig = decode_config(config_toml(fleet.urls, proxy_table, proxy=extra), "p.toml")
            papp = ProxyApp(pconfig)
            async with serve_proxy_app(papp) as (purl, _):
                ctx = papp.context
                await wait_until(lambda: ctx.fleet.state.generation > 0)
                engines = set()
                for i in range(10):
                    body = {
                        "model": MODEL,
                        "messages": [{"role": "user", "content": f"question {i}"}],
                        "max_tokens": 4,
                    }
                    async with s.post(purl + "/v1/chat/completions", json=body) as resp:
                        assert resp.status == 200, await resp.text()
                        await resp.read()
                        engines.add(resp.headers["x-fastroute-engine"])
                assert engines <= {"engine-0", "engine-1"}  # the plan keeps east traffic east
                name = f"east/{MODEL}/default"

                def east_default() -> dict[str, Any]:
                    return {c["name"]: c for c in svc.plan_json()["classes"]}[name]

                await wait_until(lambda: east_default()["measured"], timeout=5.0)
                c = east_default()
                default_rps = float(svc.model.default_rps[0])
                assert c["demand_rps"] != pytest.approx(default_rps)  # from reports now
                assert svc.forecaster.live_workers == 1
                m = svc.metrics.reports.labels(outcome="accepted")._value.get()
                assert m >= 1

                # the controller scrapes the engines itself: fresh, healthy, gauges in the plan
                def scraped() -> bool:
                    st = [e["scrape"] for e in svc.plan_json()["engines"]]
                    return all(not x["stale"] and x["healthy"] for x in st)

                await wait_until(scraped, timeout=5.0)
                e0 = svc.plan_json()["engines"][0]
                assert e0["scrape"]["error"] is None and e0["scrape"]["running"] is not None
                assert "kv_cache_usage" in e0["signals"] and e0["signals_age_s"] is not None
                async with s.get(curl + "/metrics") as resp:
                    text = await resp.text()
                assert 'fastroute_controller_engine_stale{engine="engine-0"} 0.0' in text

    run(main(), timeout=30.0)


def test_cli_serves_and_stops_cleanly_on_sigterm(
    shm_name: str, tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """``python -m controller`` publishes, answers /health, exits 0 on SIGTERM, keeps the table."""
    port = free_port()
    cfg = tmp_path / "c.toml"
    cfg.write_text(config_toml(FAKE_URLS, "unused-name", port=port))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "controller", "--config", str(cfg), "--table", shm_name],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    procs.append(proc)
    poll_until(lambda: http_get(port, "/health")[0] == 200, "controller /health", timeout=10.0)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10.0) == 0, proc.stderr.read() if proc.stderr else ""
    assert _local(shm_name).generation >= 1
    assert not (shm_dir() / "unused-name").exists()
