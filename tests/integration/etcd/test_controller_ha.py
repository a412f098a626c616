"""Three ``fastroute controller`` processes on a real 3-member etcd cluster, one proxy, two
emulated engines, all on loopback (lease TTL 2 s).

Exactly one controller leads; followers answer ``/v1/table`` with a 307 to the leader and relay
the proxy's reports to it. SIGKILL of the leader: a follower leads with a higher epoch within
TTL + a renewal + a period, and the proxy (pointed at a follower, following the 307) applies the
new epoch's tables while every request through it succeeds. All etcd members gone: the leader
steps down and the proxy keeps serving its last table.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from fastroute.testing.configs import engines_toml, stack_toml
from fastroute.testing.etcd import EtcdCluster
from fastroute.testing.processes import (
    child_env,
    free_port,
    http_get,
    http_metric,
    kill_groups,
    start_engines,
    start_fastroute,
)
from fastroute.testing.waiting import poll_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "demo-8b"
TTL_S = 2


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    kill_groups(started)


def _health(port: int) -> dict[str, object] | None:
    status, body = http_get(port, "/health", timeout_s=2.0)
    return json.loads(body) if status else None


def _leaders(ports: list[int]) -> list[int]:
    return [p for p in ports if (_health(p) or {}).get("role") == "leader"]


def _complete(port: int) -> str:
    with openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=10.0
    ) as client:
        out = client.completions.create(model=MODEL, prompt="hello", max_tokens=4)
    return out.choices[0].text


def test_one_leader_failover_and_etcd_outage(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]], etcd_cluster: EtcdCluster
) -> None:
    engines, urls = start_engines(2, child_env(tmp_path), model=MODEL)
    procs.append(engines)
    ports = [free_port() for _ in range(3)]
    proxy_port = free_port()
    config = tmp_path / "fastroute.toml"
    ha = (
        "[controller.ha]\n"
        f"etcd_urls = {json.dumps(etcd_cluster.client_urls)}\n"
        f'lease_ttl_s = {TTL_S}\netcd_timeout_s = 0.3\nelection_key = "/t/{uuid.uuid4().hex}"\n'
    )
    config.write_text(
        stack_toml(
            engines_toml(urls, MODEL),
            tag=uuid.uuid4().hex[:12],
            controller_port=ports[0],
            proxy_port=proxy_port,
            period_s=0.2,
            solve_time_limit_s=0.15,
            proxy=f'controller_url = "http://127.0.0.1:{ports[1]}"\n',
        )
        + ha
    )
    ctls = []
    for i, port in enumerate(ports):  # each controller its own host: its own shm directory
        shm = tmp_path / f"shm-c{i}"
        shm.mkdir()
        log = tmp_path / f"c{i}.log"
        args = ["controller", "--config", str(config), "--port", str(port)]
        ctls.append(start_fastroute(args, child_env(shm), log, log_level="INFO"))
        procs.append(ctls[-1])
        if i == 0:  # c0 leads first, so the proxy's controller (c1) is a follower
            poll_until(lambda: _leaders(ports) == [ports[0]], "c0 to lead")
    poll_until(lambda: all(_health(p) is not None for p in ports), "every controller up")
    for _ in range(10):
        assert _leaders(ports) == [ports[0]]
        time.sleep(0.1)
    first = _health(ports[0])
    assert first is not None and isinstance(first["epoch"], int)
    follower = _health(ports[1])
    assert follower is not None and follower["role"] == "follower"
    assert follower["leader"] == f"http://127.0.0.1:{ports[0]}"
    conn = http.client.HTTPConnection("127.0.0.1", ports[1], timeout=2.0)
    conn.request("GET", "/v1/table?format=json&cluster=local")
    resp = conn.getresponse()
    assert resp.status == 307  # the query is kept: the leader serves the region's rows
    assert resp.getheader("Location") == (
        f"http://127.0.0.1:{ports[0]}/v1/table?format=json&cluster=local"
    )
    conn.close()

    proxy_shm = tmp_path / "shm-proxy"
    proxy_shm.mkdir()
    proxy_log = tmp_path / "proxy.log"
    procs.append(
        start_fastroute(
            ["serve", "--config", str(config), "--workers", "1"], child_env(proxy_shm), proxy_log
        )
    )
    poll_until(lambda: http_get(proxy_port, "/health")[0] == 200, "proxy /health")
    poll_until(
        lambda: (
            http_metric(proxy_port, "fastroute_proxy_weights_controller_epoch") == first["epoch"]
        ),
        "the proxy to apply the first leader's table (through c1's 307)",
    )
    assert _complete(proxy_port)
    # the proxy reports to c1 (a follower), which relays to the leader: c0 sees its demand
    accepted = 'fastroute_controller_reports_total{outcome="accepted"}'
    poll_until(lambda: (http_metric(ports[0], accepted) or 0) >= 2, "relayed reports at c0")

    os.killpg(ctls[0].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    ctls[0].wait(timeout=10)
    served = 0
    while len(_leaders(ports[1:])) != 1:
        assert time.monotonic() - killed_at < TTL_S + TTL_S / 3 + 3.0, "no new leader"
        assert _complete(proxy_port)  # requests keep succeeding on the last table
        served += 1
    new_port = _leaders(ports[1:])[0]
    second = _health(new_port)
    assert second is not None and second["epoch"] > first["epoch"]
    poll_until(
        lambda: (
            http_metric(proxy_port, "fastroute_proxy_weights_controller_epoch") == second["epoch"]
        ),
        "the proxy to apply the new leader's table",
    )
    assert _complete(proxy_port)

    etcd_cluster.stop()  # every member gone: the leader must step down within the TTL
    poll_until(lambda: _leaders(ports[1:]) == [], "the leader to step down", timeout=TTL_S + 2)
    for _ in range(3):
        assert _complete(proxy_port), proxy_log.read_text()[-2000:]
    age = http_metric(proxy_port, "fastroute_proxy_table_age_seconds")
    assert age is not None and age >= 0
