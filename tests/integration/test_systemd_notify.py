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

import json
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest

from fastroute.testing.configs import engines_toml, stack_toml
from fastroute.testing.notify import NotifyReceiver
from fastroute.testing.processes import (
    child_env,
    free_port,
    http_get,
    start_engines,
    start_fastroute,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "demo-8b"


def _environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if item)


def test_controller_and_proxy_speak_sd_notify(tmp_path, procs):
    if not sys.platform.startswith("linux"):
        pytest.skip("SO_PASSCRED and /proc are Linux")
    shm = tmp_path / "shm"
    shm.mkdir()
    env = child_env(shm)
    tag = uuid.uuid4().hex[:12]
    ctl_rx = NotifyReceiver(f"\0fastroute-test-notify-{tag}")
    proxy_rx = NotifyReceiver(str(tmp_path / "proxy-notify.sock"))
    try:
        engines, urls = start_engines(2, env, model=MODEL)
        procs.append(engines)
        proxy_port, controller_port = free_port(), free_port()
        config = tmp_path / "fastroute.toml"
        config.write_text(
            stack_toml(
                engines_toml(urls, MODEL),
                tag=tag,
                controller_port=controller_port,
                proxy_port=proxy_port,
                period_s=0.2,
                solve_time_limit_s=0.15,
                proxy="drain_timeout_s = 5.0\n",
            )
        )

        # -- controller: READY=1 once the API answers and the first table is out ----------
        ctl_log, proxy_log = tmp_path / "controller.log", tmp_path / "proxy.log"
        ctl = start_fastroute(
            ["controller", "--config", str(config)],
            {**env, "NOTIFY_SOCKET": f"@fastroute-test-notify-{tag}"},
            ctl_log,
        )
        procs.append(ctl)
        pid, ready = ctl_rx.expect("READY", ctl, ctl_log)
        status, body = http_get(controller_port, "/health")
        assert (status, json.loads(body)["status"]) == (200, "ok")
        assert pid == ctl.pid and ready["READY"] == "1"
        assert ready["STATUS"].startswith("serving; table generation ")

        # -- proxy: READY=1 once both workers listen -------------------------------------
        proxy = start_fastroute(
            ["serve", "--config", str(config), "--workers", "2"],
            {**env, "NOTIFY_SOCKET": str(tmp_path / "proxy-notify.sock")},
            proxy_log,
        )
        procs.append(proxy)
        pid, ready = proxy_rx.expect("READY", proxy, proxy_log)
        assert pid == proxy.pid, "only the main process may notify (NotifyAccess=main)"
        assert ready["STATUS"] == f"2/2 workers running on 127.0.0.1:{proxy_port}"
        workers: set[int] = set()
        # http_get opens a fresh connection each time: SO_REUSEPORT spreads them over the workers
        for _ in range(40):
            status, body = http_get(proxy_port, "/health")  # never refused once READY
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
        assert http_get(proxy_port, "/health")[0] == 200

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
