"""Controller failure and restart with real processes: engines, controller and proxy on loopback.

``fastroute engine`` (2 emulated engines), ``fastroute controller`` and ``fastroute serve`` (one
worker) share a config and a private shared-memory directory (``FASTROUTE_SHM_DIR``). The
controller is SIGKILLed mid-run: the proxy must keep serving on the last table while its
``fastroute_proxy_table_age_seconds`` grows; a restarted controller takes the table over and the
proxy follows the new generations.
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
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "demo-8b"
START_TIMEOUT_S = 30.0
ENGINE_READY = re.compile(r"^engine (\S+) listening on (http://127\.0\.0\.1:\d+)$")


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


def _metric(port: int, name: str) -> float | None:
    status, body = _get(port, "/metrics")
    if status != 200:
        return None
    for line in body.decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


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
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def _fastroute(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "fastroute", "--log-level", "WARNING", *args],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, start_new_session=True,
        )  # fmt: skip


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


def _config(urls: list[str], *, proxy_port: int, controller_port: int, tag: str) -> str:
    engines = "".join(
        f'[[engines]]\nname = "engine-{i}"\nurl = "{url}"\nmodels = ["{MODEL}"]\n'
        f'hardware = "h100"\ncapacity_rps = 10.0\n\n'
        for i, url in enumerate(urls)
    )
    return (
        engines
        + f"[controller]\nport = {controller_port}\nperiod_s = 0.1\nsolve_time_limit_s = 0.08\n\n"
        + f'[proxy]\nport = {proxy_port}\ntable_name = "fastroute-test-{tag}-weights"\n'
        + f'stats_name = "fastroute-test-{tag}-stats"\n'
    )


def _complete(port: int) -> str:
    with openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=10.0
    ) as client:
        out = client.completions.create(model=MODEL, prompt="hello", max_tokens=4)
    return out.choices[0].text


def test_proxy_survives_a_killed_controller_and_follows_its_restart(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """Alive, the controller's heartbeat keeps the proxy's table age under 10 periods even
    without changes. SIGKILL the controller: requests through the proxy still succeed on the
    last table and its table age grows past the heartbeat; a restarted controller publishes
    newer generations and the proxy's table age falls back under a second."""
    shm = tmp_path / "shm"
    shm.mkdir()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FASTROUTE_SHM_DIR": str(shm)}
    for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        env.pop(key, None)
    engines, urls = _start_engines(2, env)
    procs.append(engines)
    proxy_port, ctl_port = _free_port(), _free_port()
    config = tmp_path / "fastroute.toml"
    tag = uuid.uuid4().hex[:12]
    config.write_text(_config(urls, proxy_port=proxy_port, controller_port=ctl_port, tag=tag))
    ctl_log, proxy_log = tmp_path / "controller.log", tmp_path / "proxy.log"

    def start_controller() -> subprocess.Popen[bytes]:
        proc = _fastroute(["controller", "--config", str(config)], env, ctl_log)
        procs.append(proc)
        _wait(lambda: _get(ctl_port, "/health")[0] == 200, "controller /health")
        return proc

    def generation() -> int:
        status, body = _get(ctl_port, "/health")
        return int(json.loads(body)["generation"]) if status == 200 else -1

    ctl = start_controller()
    procs.append(_fastroute(["serve", "--config", str(config), "--workers", "1"], env, proxy_log))
    _wait(lambda: _get(proxy_port, "/health")[0] == 200, "proxy /health")
    _wait(
        lambda: (_metric(proxy_port, "fastroute_proxy_table_generation") or 0) >= 1,
        "the proxy to read the controller's table",
    )
    assert _complete(proxy_port)
    gen_before = generation()
    assert gen_before >= 1
    # alive, the controller republishes even an unchanged table every 10 periods (1 s): the
    # age stays under that heartbeat (+ scheduling slack) however long we watch
    watch_until = time.monotonic() + 2.0
    while time.monotonic() < watch_until:  # observed for longer than one heartbeat
        alive_age = _metric(proxy_port, "fastroute_proxy_table_age_seconds")
        assert alive_age is not None and alive_age < 1.0 + 1.0, alive_age
        time.sleep(0.1)

    os.killpg(ctl.pid, signal.SIGKILL)
    ctl.wait(timeout=10)
    for _ in range(3):
        assert _complete(proxy_port), proxy_log.read_text()[-2000:]
    _wait(
        lambda: (_metric(proxy_port, "fastroute_proxy_table_age_seconds") or 0) > 1.0 + 2.0,
        "the table age to grow past the heartbeat while the controller is down",
        timeout_s=15.0,
    )
    gen_stale = _metric(proxy_port, "fastroute_proxy_table_generation")
    assert _complete(proxy_port)

    start_controller()
    _wait(
        lambda: (_metric(proxy_port, "fastroute_proxy_table_generation") or 0) > (gen_stale or 0),
        "the proxy to follow the restarted controller",
    )
    _wait(
        lambda: (_metric(proxy_port, "fastroute_proxy_table_age_seconds") or 99) < 1.0,
        "a fresh table",
        timeout_s=10.0,
    )
    assert generation() > gen_before
    assert _complete(proxy_port)
