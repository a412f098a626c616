"""``--mode p-controller``: the legacy baseline inside the service, published like the LP.

In-process: four h100 engines fed proxy reports, one of them 2× slower; the baseline moves
weight away from it period by period and the shared-memory table carries exactly the plan's rows.
Out of process: ``python -m controller --mode p-controller`` serves ``/v1/plan`` in that mode.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from controller_fleet import ENGINES, MODEL, two_region_toml

from controller.service import ControllerService
from fastroute.config import decode_config
from fastroute.hashing import class_key, engine_id
from fastroute.signals.reports import EngineReport, LatencySummary, Report
from fastroute.tables import TableReader
from fastroute.testing.processes import free_port, http_get
from fastroute.testing.waiting import poll_until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
ATTEMPTS = 25


def run(coro: Coroutine[Any, Any, Any], timeout: float = 25.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


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
    config = decode_config(two_region_toml(shm_name), source="c.toml")

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


def test_cli_runs_the_baseline_mode(
    shm_name: str, tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """``python -m controller --mode p-controller`` publishes and reports its mode in /v1/plan;
    a bad gain is refused with exit status 2."""
    port = free_port()
    cfg = tmp_path / "c.toml"
    cfg.write_text(two_region_toml(shm_name, port=port))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "controller", "--config", str(cfg), "--mode", "p-controller"]
    bad = subprocess.run([*cmd, "--p-gain", "0"], env=env, capture_output=True, timeout=60)
    assert bad.returncode == 2 and b"--p-gain" in bad.stderr
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    procs.append(proc)

    def plan() -> dict[str, Any]:
        status, body = http_get(port, "/v1/plan")
        return dict(json.loads(body)) if status == 200 else {}

    poll_until(lambda: plan().get("plan_id") is not None, "a plan", timeout=10.0)
    assert plan()["mode"] == "p-controller"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10.0) == 0, proc.stderr.read() if proc.stderr else ""
