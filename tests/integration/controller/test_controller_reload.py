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

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fastroute.tables import TableReader

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "demo-8b"
START_TIMEOUT_S = 30.0
ENGINE_READY = re.compile(r"^engine (\S+) listening on (http://127\.0\.0\.1:\d+)$")


class NotifyReceiver:
    """The service manager's side of ``NOTIFY_SOCKET`` (an abstract datagram socket)."""

    def __init__(self, name: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + name)
        self.seen: list[dict[str, str]] = []

    def expect(self, key: str, sender: subprocess.Popen[bytes], log: Path) -> dict[str, str]:
        """The next message carrying ``key``; fails at once if ``sender`` exits first."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {key}= within {START_TIMEOUT_S} s; got {self.seen}")
            self.sock.settimeout(min(left, 0.2))
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                if sender.poll() is not None:
                    raise AssertionError(
                        f"exited {sender.returncode} before {key}=:\n{log.read_text()[-3000:]}"
                    ) from None
                continue
            fields = dict(line.split("=", 1) for line in data.decode().splitlines())
            self.seen.append(fields)
            if key in fields:
                return fields

    def close(self) -> None:
        self.sock.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5.0)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    except OSError:
        return 0, b""
    finally:
        conn.close()


def _wait(cond: Callable[[], bool], what: str, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _reloads(port: int, result: str) -> float:
    status, body = _get(port, "/metrics")
    assert status == 200
    want = f'fastroute_controller_config_reloads_total{{result="{result}"}} '
    for line in body.decode().splitlines():
        if line.startswith(want):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _plan(port: int) -> dict[str, float]:
    """Engine name → configured capacity in the current plan (empty while none)."""
    status, body = _get(port, "/v1/plan")
    assert status == 200
    plan = json.loads(body)
    if plan["plan_id"] is None:
        return {}
    return {e["name"]: e["capacity_rps"] for e in plan["engines"]}


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes started by the test (own sessions); their groups are killed at teardown."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def _start_engines(n: int, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], list[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastroute", "--log-level", "WARNING", "engine", "--count", str(n),
         "--base-port", "0", "--profile", "h100", "--model", MODEL],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        env=env, start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    urls: list[str] = []
    deadline = time.monotonic() + START_TIMEOUT_S
    while len(urls) < n:
        assert time.monotonic() < deadline, "engines did not start"
        line = proc.stdout.readline().decode().strip()
        assert line or proc.poll() is None, "fastroute engine exited early"
        match = ENGINE_READY.match(line)
        if match:
            urls.append(match.group(2))
    return proc, urls


def _config(urls: list[str], capacities: list[str], *, port: int, table: str) -> str:
    engines = "".join(
        f'[[engines]]\nname = "engine-{i}"\nurl = "{url}"\nmodels = ["{MODEL}"]\n'
        f'hardware = "h100"\ncapacity_rps = {cap}\n\n'
        for i, (url, cap) in enumerate(zip(urls, capacities, strict=False))
    )
    # period 0.5 s: the unchanged-plan heartbeat (10 periods) is 5 s, so the reload's own
    # publication is what answers the parked long-poll
    return (
        engines
        + f"[controller]\nport = {port}\nperiod_s = 0.5\nsolve_time_limit_s = 0.3\n"
        + "long_poll_timeout_s = 20.0\n\n"
        + f'[proxy]\ntable_name = "{table}"\n'
    )


def test_sighup_reloads_the_config_without_dropping_the_listener(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("FASTROUTE_SHM_DIR", str(shm))  # this process reads the table too
    tag = uuid.uuid4().hex[:12]
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "FASTROUTE_SHM_DIR": str(shm),
        "NOTIFY_SOCKET": f"@fastroute-test-reload-{tag}",
    }
    for key in ("WATCHDOG_USEC", "WATCHDOG_PID"):
        env.pop(key, None)
    engine_env = {k: v for k, v in env.items() if k != "NOTIFY_SOCKET"}
    rx = NotifyReceiver(f"fastroute-test-reload-{tag}")
    try:
        engines, urls = _start_engines(3, engine_env)
        procs.append(engines)
        port = _free_port()
        table = f"fastroute-test-{tag}-weights"
        config = tmp_path / "fastroute.toml"
        config.write_text(_config(urls, ["10.0", "10.0"], port=port, table=table))
        log = tmp_path / "controller.log"
        with log.open("wb") as out:
            ctl = subprocess.Popen(
                [sys.executable, "-m", "fastroute", "--log-level", "INFO", "controller",
                 "--config", str(config)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, start_new_session=True,
            )  # fmt: skip
        procs.append(ctl)
        rx.expect("READY", ctl, log)
        assert _plan(port) == {"engine-0": 10.0, "engine-1": 10.0}
        # steady after a few periods: no new generation until the heartbeat (5 s)
        _wait(
            lambda: json.loads(_get(port, "/v1/plan")[1])["periods_total"] >= 3,
            "three control periods",
            10.0,
        )
        gen0 = int(json.loads(_get(port, "/health")[1])["generation"])
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
        _wait(
            lambda: b"fastroute_controller" in _get(port, "/metrics")[1],
            "the controller to answer while the poll is parked",
        )
        assert poller.is_alive() and not answer  # parked

        # -- a changed config: new capacity, one more engine --------------------------
        config.write_text(_config(urls, ["25.0", "10.0", "5.0"], port=port, table=table))
        t_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        ctl.send_signal(signal.SIGHUP)
        reloading = rx.expect("RELOADING", ctl, log)
        assert int(reloading["MONOTONIC_USEC"]) >= t_usec
        ready = rx.expect("READY", ctl, log)
        assert "FAILED" not in ready["STATUS"], ready
        assert _plan(port) == {"engine-0": 25.0, "engine-1": 10.0, "engine-2": 5.0}
        assert _reloads(port, "ok") == 1.0
        gen1 = int(json.loads(_get(port, "/health")[1])["generation"])
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
        config.write_text(_config(urls, ["25.0", "-1.0", "5.0"], port=port, table=table))
        ctl.send_signal(signal.SIGHUP)
        rx.expect("RELOADING", ctl, log)
        ready = rx.expect("READY", ctl, log)
        assert "config reload FAILED" in ready["STATUS"], ready
        assert "$.engines[1].capacity_rps" in ready["STATUS"]
        assert ctl.poll() is None
        assert _reloads(port, "error") == 1.0 and _reloads(port, "ok") == 1.0
        assert _plan(port) == {"engine-0": 25.0, "engine-1": 10.0, "engine-2": 5.0}
        status, body = _get(port, "/health")
        assert status == 200
        assert "$.engines[1].capacity_rps" in json.loads(body)["last_reload_error"]
        assert int(json.loads(body)["generation"]) >= gen1
        text = log.read_text()
        assert "config reload failed" in text and str(config) in text
        assert "$.engines[1].capacity_rps" in text

        # -- a new listen port needs a restart; the rest is applied --------------------
        other = _free_port()
        config.write_text(_config(urls, ["25.0", "12.0", "5.0"], port=other, table=table))
        ctl.send_signal(signal.SIGHUP)
        rx.expect("RELOADING", ctl, log)
        ready = rx.expect("READY", ctl, log)
        assert "FAILED" not in ready["STATUS"], ready
        assert _plan(port)["engine-1"] == 12.0  # still on the old port
        assert _get(other, "/health")[0] == 0
        assert f"listen address 127.0.0.1:{port} -> 127.0.0.1:{other} needs a restart" in (
            log.read_text()
        )
        assert json.loads(_get(port, "/health")[1])["last_reload_error"] is None

        # -- a burst of SIGHUPs on an unchanged file: coalesced, nothing rebuilt ---------
        for _ in range(5):
            ctl.send_signal(signal.SIGHUP)
        _wait(lambda: _reloads(port, "unchanged") >= 1, "the unchanged reloads", 10.0)
        assert ctl.poll() is None and _reloads(port, "ok") == 2.0
        assert _plan(port)["engine-1"] == 12.0

        ctl.send_signal(signal.SIGTERM)
        rx.expect("STOPPING", ctl, log)
        assert ctl.wait(timeout=20) == 0, log.read_text()[-3000:]
        engines.send_signal(signal.SIGTERM)
        assert engines.wait(timeout=20) == 0
    finally:
        rx.close()
