"""SIGHUP config reload of a real ``fastroute controller`` process.

Real processes on loopback: ``fastroute engine`` (3 emulated engines, the config lists 2 at
first) and ``fastroute controller`` with ``NOTIFY_SOCKET`` pointing at a datagram socket the test
owns. Asserted, in one controller lifetime:

* a changed config (engine-0's capacity 10 → 25, engine-2 added) → ``RELOADING=1`` with a
  current ``MONOTONIC_USEC``, then ``READY=1``; ``/v1/plan`` shows the new engines and capacity;
  the table generation went up (same shared-memory table); a ``/v1/table`` long-poll parked
  before the SIGHUP is answered 200 on its connection, which then serves another request;
* a broken config → the controller keeps serving on the previous config (plan unchanged,
  ``/health`` 200 naming the bad JSON path), the error is logged with the file and JSON path,
  ``fastroute_controller_config_reloads_total{result="error"}`` counts it, ``STATUS=`` says so;
* a changed listen port → logged as needing a restart, the old port keeps serving;
* a burst of SIGHUPs with the file unchanged → counted as ``unchanged``, the controller lives.
"""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from fastroute.tables import TableReader
from fastroute.testing.configs import engines_toml, stack_toml
from fastroute.testing.notify import NotifyReceiver
from fastroute.testing.processes import (
    child_env,
    free_port,
    http_get,
    http_metric,
    start_engines,
    start_fastroute,
)
from fastroute.testing.waiting import poll_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "demo-8b"


def _reloads(port: int, result: str) -> float:
    value = http_metric(port, f'fastroute_controller_config_reloads_total{{result="{result}"}}')
    return 0.0 if value is None else value


def _plan(port: int) -> dict[str, float]:
    """Engine name → configured capacity in the current plan (empty while none)."""
    status, body = http_get(port, "/v1/plan")
    assert status == 200
    plan = json.loads(body)
    if plan["plan_id"] is None:
        return {}
    return {e["name"]: e["capacity_rps"] for e in plan["engines"]}


def _config(urls: list[str], capacities: list[str], *, port: int, tag: str) -> str:
    # period 0.5 s: the unchanged-plan heartbeat (10 periods) is 5 s, so the reload's own
    # publication is what answers the parked long-poll
    return stack_toml(
        engines_toml(urls[: len(capacities)], MODEL, capacity_rps=capacities),
        tag=tag,
        controller_port=port,
        period_s=0.5,
        solve_time_limit_s=0.3,
        controller="long_poll_timeout_s = 20.0\n",
    )


def test_sighup_reloads_the_config_without_dropping_the_listener(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("FASTROUTE_SHM_DIR", str(shm))  # this process reads the table too
    tag = uuid.uuid4().hex[:12]
    engine_env = child_env(shm)
    env = engine_env | {"NOTIFY_SOCKET": f"@fastroute-test-reload-{tag}"}
    rx = NotifyReceiver(f"\0fastroute-test-reload-{tag}")
    try:
        engines, urls = start_engines(3, engine_env, model=MODEL)
        procs.append(engines)
        port = free_port()
        table = f"fastroute-test-{tag}-weights"
        config = tmp_path / "fastroute.toml"
        config.write_text(_config(urls, ["10.0", "10.0"], port=port, tag=tag))
        log = tmp_path / "controller.log"
        ctl = start_fastroute(["controller", "--config", str(config)], env, log, log_level="INFO")
        procs.append(ctl)
        rx.expect("READY", ctl, log)
        assert _plan(port) == {"engine-0": 10.0, "engine-1": 10.0}
        # steady after a few periods: no new generation until the heartbeat (5 s)
        poll_until(
            lambda: json.loads(http_get(port, "/v1/plan")[1])["periods_total"] >= 3,
            "three control periods",
            10.0,
        )
        gen0 = int(json.loads(http_get(port, "/health")[1])["generation"])
        assert gen0 >= 1

        # -- a parked long-poll on a keep-alive connection ------------------------------
        poll = http.client.HTTPConnection("127.0.0.1", port, timeout=15.0)
        answer: dict[str, object] = {}

        def long_poll() -> None:
            try:
                resp = poll.getresponse()
                answer["status"], answer["body"] = resp.status, resp.read()
            except OSError as exc:
                answer["error"] = exc

        # sent before the round trip below, so the controller has read it (and parked it: no
        # new generation for 5 s) by the time it answers that
        poll.request("GET", f"/v1/table?after={gen0}&timeout_s=15&format=json")
        poller = threading.Thread(target=long_poll, daemon=True)
        poller.start()
        poll_until(
            lambda: b"fastroute_controller" in http_get(port, "/metrics")[1],
            "the controller to answer while the poll is parked",
        )
        assert poller.is_alive() and not answer  # parked

        # -- a changed config: new capacity, one more engine --------------------------
        config.write_text(_config(urls, ["25.0", "10.0", "5.0"], port=port, tag=tag))
        t_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        ctl.send_signal(signal.SIGHUP)
        _, reloading = rx.expect("RELOADING", ctl, log)
        assert int(reloading["MONOTONIC_USEC"]) >= t_usec
        _, ready = rx.expect("READY", ctl, log)
        assert "FAILED" not in ready["STATUS"], ready
        assert _plan(port) == {"engine-0": 25.0, "engine-1": 10.0, "engine-2": 5.0}
        assert _reloads(port, "ok") == 1.0
        gen1 = int(json.loads(http_get(port, "/health")[1])["generation"])
        assert gen1 > gen0
        reader = TableReader(table)
        try:
            snap = reader.snapshot()  # the same shared-memory table, now with 3 engines
        finally:
            reader.close()
        assert snap.n_engines == 3 and snap.generation >= gen1

        poller.join(timeout=15.0)
        assert not poller.is_alive() and "error" not in answer, answer
        assert answer["status"] == 200
        assert json.loads(answer["body"])["generation"] > gen0  # type: ignore[arg-type]
        poll.request("GET", "/health")  # the same connection is still open
        assert poll.getresponse().status == 200
        poll.close()

        # -- a broken config: keep serving the previous one ----------------------------
        config.write_text(_config(urls, ["25.0", "-1.0", "5.0"], port=port, tag=tag))
        ctl.send_signal(signal.SIGHUP)
        rx.expect("RELOADING", ctl, log)
        _, ready = rx.expect("READY", ctl, log)
        assert "config reload FAILED" in ready["STATUS"], ready
        assert "$.engines[1].capacity_rps" in ready["STATUS"]
        assert ctl.poll() is None
        assert _reloads(port, "error") == 1.0 and _reloads(port, "ok") == 1.0
        assert _plan(port) == {"engine-0": 25.0, "engine-1": 10.0, "engine-2": 5.0}
        status, body = http_get(port, "/health")
        assert status == 200
        assert "$.engines[1].capacity_rps" in json.loads(body)["last_reload_error"]
        assert int(json.loads(body)["generation"]) >= gen1
        text = log.read_text()
        assert "config reload failed" in text and str(config) in text
        assert "$.engines[1].capacity_rps" in text

        # -- a new listen port needs a restart; the rest is applied --------------------
        other = free_port()
        config.write_text(_config(urls, ["25.0", "12.0", "5.0"], port=other, tag=tag))
        ctl.send_signal(signal.SIGHUP)
        rx.expect("RELOADING", ctl, log)
        _, ready = rx.expect("READY", ctl, log)
        assert "FAILED" not in ready["STATUS"], ready
        assert _plan(port)["engine-1"] == 12.0  # still on the old port
        assert http_get(other, "/health")[0] == 0
        assert f"listen address 127.0.0.1:{port} -> 127.0.0.1:{other} needs a restart" in (
            log.read_text()
        )
        assert json.loads(http_get(port, "/health")[1])["last_reload_error"] is None

        # -- a burst of SIGHUPs on an unchanged file: coalesced, nothing rebuilt ---------
        for _ in range(5):
            ctl.send_signal(signal.SIGHUP)
        poll_until(lambda: _reloads(port, "unchanged") >= 1, "the unchanged reloads", 10.0)
        assert ctl.poll() is None and _reloads(port, "ok") == 2.0
        assert _plan(port)["engine-1"] == 12.0

        ctl.send_signal(signal.SIGTERM)
        rx.expect("STOPPING", ctl, log)
        assert ctl.wait(timeout=20) == 0, log.read_text()[-3000:]
        engines.send_signal(signal.SIGTERM)
        assert engines.wait(timeout=20) == 0
    finally:
        rx.close()
