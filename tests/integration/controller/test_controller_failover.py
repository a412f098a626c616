"""Controller failure and restart with real processes: engines, controller and proxy on loopback.

``fastroute engine`` (2 emulated engines), ``fastroute controller`` and ``fastroute serve`` (one
worker) share a config and a private shared-memory directory (``FASTROUTE_SHM_DIR``). The
controller is SIGKILLed mid-run: the proxy must keep serving on the last table while its
``fastroute_proxy_table_age_seconds`` grows; a restarted controller takes the table over and the
proxy follows the new generations.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import openai
import pytest

from fastroute.testing.configs import engines_toml, stack_toml
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
    env = child_env(shm)
    engines, urls = start_engines(2, env, model=MODEL)
    procs.append(engines)
    proxy_port, ctl_port = free_port(), free_port()
    config = tmp_path / "fastroute.toml"
    tag = uuid.uuid4().hex[:12]
    config.write_text(
        stack_toml(
            engines_toml(urls, MODEL),
            tag=tag,
            controller_port=ctl_port,
            proxy_port=proxy_port,
            period_s=0.1,
            solve_time_limit_s=0.08,
        )
    )
    ctl_log, proxy_log = tmp_path / "controller.log", tmp_path / "proxy.log"

    def start_controller() -> subprocess.Popen[bytes]:
        proc = start_fastroute(["controller", "--config", str(config)], env, ctl_log)
        procs.append(proc)
        poll_until(lambda: http_get(ctl_port, "/health")[0] == 200, "controller /health")
        return proc

    def generation() -> int:
        status, body = http_get(ctl_port, "/health")
        return int(json.loads(body)["generation"]) if status == 200 else -1

    ctl = start_controller()
    procs.append(
        start_fastroute(["serve", "--config", str(config), "--workers", "1"], env, proxy_log)
    )
    poll_until(lambda: http_get(proxy_port, "/health")[0] == 200, "proxy /health")
    poll_until(
        lambda: (http_metric(proxy_port, "fastroute_proxy_table_generation") or 0) >= 1,
        "the proxy to read the controller's table",
    )
    assert _complete(proxy_port)
    gen_before = generation()
    assert gen_before >= 1
    # alive, the controller republishes even an unchanged table every 10 periods (1 s): the
    # age stays under that heartbeat (+ scheduling slack) however long we watch
    watch_until = time.monotonic() + 2.0
    while time.monotonic() < watch_until:  # observed for longer than one heartbeat
        alive_age = http_metric(proxy_port, "fastroute_proxy_table_age_seconds")
        assert alive_age is not None and alive_age < 1.0 + 1.0, alive_age
        time.sleep(0.1)

    os.killpg(ctl.pid, signal.SIGKILL)
    ctl.wait(timeout=10)
    for _ in range(3):
        assert _complete(proxy_port), proxy_log.read_text()[-2000:]
    poll_until(
        lambda: (http_metric(proxy_port, "fastroute_proxy_table_age_seconds") or 0) > 1.0 + 2.0,
        "the table age to grow past the heartbeat while the controller is down",
        timeout=15.0,
    )
    gen_stale = http_metric(proxy_port, "fastroute_proxy_table_generation")
    assert _complete(proxy_port)

    start_controller()
    poll_until(
        lambda: (
            (http_metric(proxy_port, "fastroute_proxy_table_generation") or 0) > (gen_stale or 0)
        ),
        "the proxy to follow the restarted controller",
    )
    poll_until(
        lambda: (http_metric(proxy_port, "fastroute_proxy_table_age_seconds") or 99) < 1.0,
        "a fresh table",
        timeout=10.0,
    )
    assert generation() > gen_before
    assert _complete(proxy_port)
