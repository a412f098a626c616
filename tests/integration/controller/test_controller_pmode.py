"""``--mode p-controller``: the legacy baseline inside the service, published like the LP.

In-process: four h100 engines fed proxy reports, one of them 2× slower; the baseline moves
weight away from it period by period and the shared-memory table carries exactly the plan's rows.
Out of process: ``python -m controller --mode p-controller`` serves ``/v1/plan`` in that mode.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from controller.service import ControllerService
from fastroute.config import decode_config
from fastroute.hashing import class_key, engine_id
from fastroute.signals.reports import EngineReport, LatencySummary, Report
from fastroute.tables import TableReader
from fastroute.testing.waiting import wait_until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
MODEL = "demo-8b"
ENGINES = [f"engine-{i}" for i in range(4)]
REGIONS = ("east", "west")
ATTEMPTS = 25


def run(coro: Coroutine[Any, Any, Any], timeout: float = 25.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def config_toml(table_name: str, port: int = 0) -> str:
    engines = "".join(
        f'[[engines]]\nname = "{name}"\nurl = "http://127.0.0.1:{9 + i}"\n'
        f'models = ["{MODEL}"]\nregion = "{REGIONS[i // 2]}"\nhardware = "h100"\n'
        "capacity_rps = 10.0\n\n"
        for i, name in enumerate(ENGINES)
    )
    return (
        engines
        + '[[network.regions]]\nname = "east"\n\n[[network.regions]]\nname = "west"\n\n'
        + "[network.rtt_ms]\neast = { west = 80.0 }\n\n"
        + f"[controller]\nport = {port}\nperiod_s = 0.2\nsolve_time_limit_s = 0.15\n\n"
        + f'[proxy]\nport = 0\ncluster = "east"\ntable_name = "{table_name}"\n'
    )


def report(slow: dict[str, float]) -> Report:
    now = time.time()
    engines = []
    for name in ENGINES:
        mean_s = 0.1 * slow.get(name, 1.0)
        ttft = LatencySummary(ATTEMPTS, ATTEMPTS * mean_s, mean_s, mean_s, mean_s, mean_s, [])
        engines.append(EngineReport(engine_id(name), ATTEMPTS, {}, ttft))
    return Report(1, "east", "w-1", now - 5.0, now, [], engines)


def test_p_controller_mode_moves_weight_off_a_slow_engine_and_publishes(shm_name: str) -> None:
    """engine-0 2× slower: its weight falls every period in every class (no LP, no derating
    needed); the table rows equal the plan's weights; the plan says which mode made it."""
    config = decode_config(config_toml(shm_name), source="c.toml")

    async def main() -> list[np.ndarray]:
        svc = ControllerService(config, mode="p-controller", p_gain=0.3, p_ewma_alpha=1.0)
        svc.open()
        history = []
        try:
            for _ in range(5):
                svc.observe(report({"engine-0": 2.0}))
                await svc.step()
                assert svc.plan is not None
                history.append(svc.plan.weights.copy())
            plan = svc.plan_json()
            assert plan["mode"] == "p-controller" and plan["solve"]["status"] == "p-controller"
            reader = TableReader(shm_name)
            try:
                snap = reader.snapshot()
            finally:
                reader.close()
            rows = {int(k): i for i, k in enumerate(snap.class_keys)}
            cols = [int(np.flatnonzero(snap.engine_ids == engine_id(n))[0]) for n in ENGINES]
            for g, c in enumerate(svc.model.classes):
                np.testing.assert_allclose(snap.weights[rows[c.key]][cols], svc.plan.weights[g])
            assert class_key("east", MODEL, "default") in rows
        finally:
            svc.close()
        return history

    history = run(main())
    w0 = [h[:, 0] for h in history]
    assert all(np.all(w0[i + 1] < w0[i]) for i in range(len(w0) - 1))
    assert np.allclose(history[-1].sum(axis=1), 1.0)


def test_cli_runs_the_baseline_mode(shm_name: str, tmp_path: Path) -> None:
    """``python -m controller --mode p-controller`` publishes and reports its mode in /v1/plan;
    a bad gain is refused with exit status 2."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    cfg = tmp_path / "c.toml"
    cfg.write_text(config_toml(shm_name, port=port))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "controller", "--config", str(cfg), "--mode", "p-controller"]
    bad = subprocess.run([*cmd, "--p-gain", "0"], env=env, capture_output=True, timeout=60)
    assert bad.returncode == 2 and b"--p-gain" in bad.stderr
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:

        async def plan_mode() -> str:
            got: dict[str, Any] = {}

            async def ok() -> bool:
                try:
                    async with (
                        aiohttp.ClientSession() as s,
                        s.get(f"http://127.0.0.1:{port}/v1/plan") as resp,
                    ):
                        got.update(await resp.json())
                        return resp.status == 200 and got.get("plan_id") is not None
                except aiohttp.ClientError:
                    return False

            await wait_until(ok, timeout=10.0, interval=0.05)
            return str(got["mode"])

        assert run(plan_mode()) == "p-controller"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10.0) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
