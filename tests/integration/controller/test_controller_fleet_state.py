"""The controller plans over the proxy's merged fleet: config + engines state file.

Real processes on loopback: ``fastroute engine`` (3 emulated engines; the config lists 2)
and ``fastroute controller``. The test writes the engines state file as the proxy's admin
API does (:func:`fastroute.discovery.state_file.update_state`); the controller notices the
change without a signal and its next plan and weight table cover the new fleet.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from fastroute.config import decode_engine
from fastroute.discovery.state_file import state_path_of, update_state
from fastroute.hashing import engine_id
from fastroute.tables import TableReader
from fastroute.testing.configs import engines_toml, stack_toml
from fastroute.testing.processes import (
    child_env,
    free_port,
    http_get,
    start_engines,
    start_fastroute,
)
from fastroute.testing.waiting import poll_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "demo-8b"
#: Engine state file poll (1 s) + a period + a solve, with margin for a loaded machine.
FLEET_CHANGE_TIMEOUT_S = 15.0


def _planned(port: int) -> set[str]:
    status, body = http_get(port, "/v1/plan")
    if status != 200:  # 0: not listening yet
        return set()
    plan = json.loads(body)
    return set() if plan["plan_id"] is None else {e["name"] for e in plan["engines"]}


def test_controller_follows_the_engines_state_file(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("FASTROUTE_SHM_DIR", str(shm))
    tag = uuid.uuid4().hex[:12]
    env = child_env(shm)
    engines, urls = start_engines(3, env, model=MODEL)
    procs.append(engines)
    port = free_port()
    config = tmp_path / "fastroute.toml"
    config.write_text(
        stack_toml(
            engines_toml(urls[:2], MODEL),
            tag=tag,
            controller_port=port,
            period_s=0.5,
            solve_time_limit_s=0.3,
        )
    )
    log = tmp_path / "controller.log"
    procs.append(start_fastroute(["controller", "--config", str(config)], env, log))
    poll_until(lambda: _planned(port) == {"engine-0", "engine-1"}, "the first plan", 20.0)

    added = decode_engine(
        {"name": "admin-2", "url": urls[2], "models": [MODEL], "hardware": "h100"}
    )
    update_state(state_path_of(config), lambda s: replace(s, engines=(added,)))
    poll_until(
        lambda: _planned(port) == {"engine-0", "engine-1", "admin-2"},
        "a plan with the added engine",
        FLEET_CHANGE_TIMEOUT_S,
    )
    with TableReader(f"fastroute-test-{tag}-weights") as table:
        poll_until(
            lambda: engine_id("admin-2") in {int(i) for i in table.snapshot().engine_ids},
            "the added engine in the weight table",
            FLEET_CHANGE_TIMEOUT_S,
        )

    update_state(state_path_of(config), lambda s: replace(s, draining=frozenset({"engine-0"})))
    poll_until(
        lambda: _planned(port) == {"engine-1", "admin-2"},
        "a plan without the draining engine",
        FLEET_CHANGE_TIMEOUT_S,
    )
