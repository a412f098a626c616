"""The systemd notify protocol end to end: real ``fastroute engine``, ``controller`` and ``serve``.

Each service gets ``NOTIFY_SOCKET`` pointing at a datagram socket the test owns (the
controller an abstract ``@name``, the proxy a filesystem path), with ``SO_PASSCRED`` on, so
every message also tells which process sent it: the units use ``NotifyAccess=main``, so only
the main process (the one systemd started) may notify. Asserted:

* controller: ``READY=1`` arrives only once its HTTP API answers and the first table is
  published (``/health`` 200 at that moment); SIGTERM → ``STOPPING=1``, exit 0;
* proxy (2 workers): ``READY=1`` once every worker listens (both answer ``/health`` at
  once, no worker inherited ``NOTIFY_SOCKET``); SIGHUP → ``RELOADING=1`` with a current
  ``MONOTONIC_USEC`` then ``READY=1``; SIGTERM → ``STOPPING=1`` with
  ``EXTEND_TIMEOUT_USEC`` covering the drain, exit 0.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "demo-8b"
START_TIMEOUT_S = 30.0
ENGINE_READY = re.compile(r"^engine (\S+) listening on (http://127\.0\.0\.1:\d+)$")
_UCRED = struct.Struct("3i")  # pid, uid, gid


class NotifyReceiver:
    """The service manager's side of ``NOTIFY_SOCKET``: datagrams with the sender's pid."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.seen: list[tuple[int, dict[str, str]]] = []

    def expect(
        self, key: str, sender: subprocess.Popen[bytes], log: Path
    ) -> tuple[int, dict[str, str]]:
        """The next message carrying ``key`` (earlier ones are kept in ``seen``); fails at
        once if ``sender`` exits first (with its ``log``)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {key}= within {START_TIMEOUT_S} s; got {self.seen}")
            self.sock.settimeout(min(left, 0.2))
            try:
                data, ancdata, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(_UCRED.size))
            except TimeoutError:  # nothing queued: fail now if the sender is gone
                if sender.poll() is not None:
                    raise AssertionError(
                        f"exited {sender.returncode} before {key}=:\n{log.read_text()[-3000:]}"
                    ) from None
                continue
            pid = next(
                _UCRED.unpack(d[: _UCRED.size])[0]
                for level, kind, d in ancdata
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS
            )
            text = data.decode()
            assert text.endswith("\n"), text
            fields = dict(line.split("=", 1) for line in text.splitlines())
            self.seen.append((pid, fields))
            if key in fields:
                return pid, fields

    def close(self) -> None:
        self.sock.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(port: int, path: str) -> tuple[int, bytes]:
    """GET on a fresh connection (so SO_REUSEPORT may pick any worker)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5.0)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
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
    with log.open("wb") as out:
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
    os.set_blocking(proc.stdout.fileno(), True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while len(urls) < n:  # one "listening" line per engine, then the engines serve
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
        + f"[controller]\nport = {controller_port}\nperiod_s = 0.2\nsolve_time_limit_s = 0.15\n\n"
        + f'[proxy]\nport = {proxy_port}\ntable_name = "fastroute-test-{tag}-weights"\n'
        + f'stats_name = "fastroute-test-{tag}-stats"\ndrain_timeout_s = 5.0\n'
    )


def _environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if item)


def test_controller_and_proxy_speak_sd_notify(tmp_path, procs):
    if not sys.platform.startswith("linux"):
        pytest.skip("SO_PASSCRED and /proc are Linux")
    shm = tmp_path / "shm"
    shm.mkdir()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FASTROUTE_SHM_DIR": str(shm)}
    for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        env.pop(key, None)
    tag = uuid.uuid4().hex[:12]
    ctl_rx = NotifyReceiver(f"\0fastroute-test-notify-{tag}")
    proxy_rx = NotifyReceiver(str(tmp_path / "proxy-notify.sock"))
    try:
        engines, urls = _start_engines(2, env)
        procs.append(engines)
        proxy_port, controller_port = _free_port(), _free_port()
        config = tmp_path / "fastroute.toml"
        config.write_text(
            _config(urls, proxy_port=proxy_port, controller_port=controller_port, tag=tag)
        )

        # -- controller: READY=1 once the API answers and the first table is out ----------
        ctl_log, proxy_log = tmp_path / "controller.log", tmp_path / "proxy.log"
        ctl = _fastroute(
            ["controller", "--config", str(config)],
            {**env, "NOTIFY_SOCKET": f"@fastroute-test-notify-{tag}"},
            ctl_log,
        )
        procs.append(ctl)
        pid, ready = ctl_rx.expect("READY", ctl, ctl_log)
        status, body = _get(controller_port, "/health")
        assert (status, json.loads(body)["status"]) == (200, "ok")
        assert pid == ctl.pid and ready["READY"] == "1"
        assert ready["STATUS"].startswith("serving; table generation ")

        # -- proxy: READY=1 once both workers listen -------------------------------------
        proxy = _fastroute(
            ["serve", "--config", str(config), "--workers", "2"],
            {**env, "NOTIFY_SOCKET": str(tmp_path / "proxy-notify.sock")},
            proxy_log,
        )
        procs.append(proxy)
        pid, ready = proxy_rx.expect("READY", proxy, proxy_log)
        assert pid == proxy.pid, "only the main process may notify (NotifyAccess=main)"
        assert ready["STATUS"] == f"2/2 workers running on 127.0.0.1:{proxy_port}"
        workers: set[int] = set()
        for _ in range(40):  # fresh connections: SO_REUSEPORT spreads them over the workers
            status, body = _get(proxy_port, "/health")  # never refused once READY
            assert status == 200, body
            workers.add(int(json.loads(body)["pid"]))
            if len(workers) == 2:
                break
        assert len(workers) == 2, workers
        for worker in workers:
            assert "NOTIFY_SOCKET" not in _environ_of(worker)

        # -- proxy reload: RELOADING=1 + MONOTONIC_USEC, then READY=1 ---------------------
        before_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        proxy.send_signal(signal.SIGHUP)
        pid, reloading = proxy_rx.expect("RELOADING", proxy, proxy_log)
        after_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        assert pid == proxy.pid
        assert before_usec <= int(reloading["MONOTONIC_USEC"]) <= after_usec
        pid, ready = proxy_rx.expect("READY", proxy, proxy_log)
        assert pid == proxy.pid and ready["READY"] == "1"
        assert _get(proxy_port, "/health")[0] == 200

        # -- stops: STOPPING=1 (the proxy asks for its drain time), exit 0 ----------------
        proxy.send_signal(signal.SIGTERM)
        pid, stopping = proxy_rx.expect("STOPPING", proxy, proxy_log)
        assert pid == proxy.pid
        assert int(stopping["EXTEND_TIMEOUT_USEC"]) >= 5_000_000  # drain_timeout_s = 5
        assert proxy.wait(timeout=20) == 0, proxy_log.read_text()

        ctl.send_signal(signal.SIGTERM)
        pid, stopping = ctl_rx.expect("STOPPING", ctl, ctl_log)
        assert pid == ctl.pid
        assert ctl.wait(timeout=20) == 0, ctl_log.read_text()

        engines.send_signal(signal.SIGTERM)
        assert engines.wait(timeout=20) == 0
        # the proxy's stats block is gone; the controller leaves its table for the proxies
        assert sorted(p.name for p in shm.iterdir()) == [
            f"fastroute-test-{tag}-weights",
            f"fastroute-test-{tag}-weights.lock",
        ]
    finally:
        ctl_rx.close()
        proxy_rx.close()
