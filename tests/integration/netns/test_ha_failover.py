"""Controller failover across hosts: etcd, three controllers and two regions in namespaces.

Nine network namespaces on one bridge (:mod:`fastroute.testing.netns`): three etcd members, one
per host; three controllers on ``[controller.ha]`` (lease TTL 2 s), one per host; two region
hosts with two emulated engines and a proxy each; a client host. Each proxy's ``controller_url``
is the first controller and its ``controller_fallback_urls`` the other two. Every hop — proxy to
controller, controller to etcd, etcd member to member — is a real socket between namespaces.

While the client host drives steady streamed load through both proxies, the test SIGKILLs the
leading controller, waits for another to lead with a higher epoch, and kills that one too. No
request may fail, and both proxies must end on the last leader's epoch.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from netns_fleet import (
    CLIENT,
    CONTROLLER_PORT,
    ETCD_CLIENT_PORT,
    ETCD_PEER_PORT,
    MODEL,
    PROXY_PORT,
    REGIONS,
    client,
    fleet_toml,
    metric,
    start_controller,
    start_region,
)

from fastroute.fleetbench.process import kill_group
from fastroute.testing.etcd import etcd_binary
from fastroute.testing.netns import Host, Topology, env_without_proxies

pytestmark = [pytest.mark.integration, pytest.mark.slow]


TTL_S = 2
LOAD_S = 30.0


def _start_etcd(members: list[Host], run_dir: Path) -> None:
    cluster = ",".join(f"{h.name}={h.url(ETCD_PEER_PORT)}" for h in members)
    for h in members:
        h.popen(
            [etcd_binary(), "--name", h.name, "--data-dir", str(run_dir / h.name),
             "--listen-client-urls", h.url(ETCD_CLIENT_PORT),
             "--advertise-client-urls", h.url(ETCD_CLIENT_PORT),
             "--listen-peer-urls", h.url(ETCD_PEER_PORT),
             "--initial-advertise-peer-urls", h.url(ETCD_PEER_PORT),
             "--initial-cluster", cluster, "--initial-cluster-state", "new",
             "--initial-cluster-token", run_dir.name,
             "--heartbeat-interval", "50", "--election-timeout", "500"],
            env=env_without_proxies(), log=run_dir / f"{h.name}.log",
        )  # fmt: skip


def _roles(hosts: dict[str, Host], ctls: list[str]) -> dict[str, dict]:
    out = {}
    for name in ctls:
        got = client(hosts["client"], "get", hosts[name].url(CONTROLLER_PORT) + "/health")
        out[name] = json.loads(str(got["body"])) if got.get("status") == 200 else {}
    return out


def _wait_leader(hosts: dict[str, Host], ctls: list[str], above_epoch: int) -> tuple[str, int]:
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        roles = _roles(hosts, ctls)
        leaders = [n for n, h in roles.items() if h.get("role") == "leader"]
        assert len(leaders) <= 1, f"two leaders: {roles}"
        if leaders and int(roles[leaders[0]]["epoch"]) > above_epoch:
            return leaders[0], int(roles[leaders[0]]["epoch"])
        time.sleep(0.3)
    raise AssertionError(f"no leader above epoch {above_epoch}: {_roles(hosts, ctls)}")


def test_leader_kills_lose_no_request_across_hosts(tmp_path: Path) -> None:
    with Topology() as topo:
        names = ["etcd0", "etcd1", "etcd2", "ctl0", "ctl1", "ctl2", *REGIONS, "client"]
        hosts = {n: topo.add_host(n) for n in names}
        _start_etcd([hosts[f"etcd{i}"] for i in range(3)], tmp_path)
        etcd_urls = [hosts[f"etcd{i}"].url(ETCD_CLIENT_PORT) for i in range(3)]
        ctls = ["ctl0", "ctl1", "ctl2"]
        ha = (
            f"\n[controller.ha]\netcd_urls = {json.dumps(etcd_urls)}\nlease_ttl_s = {TTL_S}\n"
            f'etcd_timeout_s = 0.3\nelection_key = "/netns/{uuid.uuid4().hex}"\n'
        )
        fallbacks = json.dumps([hosts[c].url(CONTROLLER_PORT) for c in ctls[1:]])
        proxy_extra = f"controller_fallback_urls = {fallbacks}\n"
        ctl_procs = {}
        for c in ctls:
            text = fleet_toml(hosts, "east", hosts[c]) + ha
            ctl_procs[c] = start_controller(hosts[c], text, tmp_path)
        for r in REGIONS:
            start_region(hosts[r], fleet_toml(hosts, r, hosts["ctl0"], proxy_extra) + ha, tmp_path)
        ready = [hosts[r].url(PROXY_PORT) + "/ready" for r in REGIONS]
        ready += [hosts[c].url(CONTROLLER_PORT) + "/health" for c in ctls]
        waited = client(hosts["client"], "wait", *ready)
        assert waited["ready"], f"not ready: {waited['pending']}"
        leader, epoch = _wait_leader(hosts, ctls, 0)

        loads = [
            subprocess.Popen(
                hosts["client"].argv(
                    [
                        sys.executable,
                        CLIENT,
                        "load",
                        hosts[r].url(PROXY_PORT),
                        MODEL,
                        str(LOAD_S),
                        "3",
                    ]
                ),
                stdout=subprocess.PIPE,
                text=True,
                env=env_without_proxies(),
            )  # fmt: skip
            for r in REGIONS
        ]
        try:
            for _ in range(2):  # two leaders killed, one after the other
                time.sleep(6.0)
                kill_group(ctl_procs.pop(leader), timeout_s=10.0)
                ctls.remove(leader)
                leader, epoch = _wait_leader(hosts, ctls, epoch)
            results = [json.loads(p.communicate(timeout=LOAD_S + 60)[0].splitlines()[-1])
                       for p in loads]  # fmt: skip
        finally:
            for p in loads:
                p.kill()
        for r, out in zip(REGIONS, results, strict=True):
            assert out["ok"] > 0 and out["failures"] == [], (r, out["failures"][:5])
        for r in REGIONS:  # both proxies follow the last leader's tables
            deadline = time.monotonic() + 30.0
            seen = None
            while time.monotonic() < deadline:
                seen = metric(hosts[r], hosts["client"], "fastroute_proxy_weights_controller_epoch")
                if seen == epoch:
                    break
                time.sleep(0.5)
            assert seen == epoch, f"{r} proxy on epoch {seen}, leader's is {epoch}"
