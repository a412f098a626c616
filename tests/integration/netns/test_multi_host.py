"""Two regions and a control host on one machine: every hop is a real socket between hosts.

Four network namespaces on one bridge (:mod:`fastroute.testing.netns`): ``ctl`` runs the
controller; ``east`` and ``west`` each run two emulated engines and a proxy whose
``controller_url`` is the controller's address; ``client`` runs the official ``openai`` client.
Nothing binds loopback except inside its own namespace, so the proxy can only reach the
engines and the controller over the bridge, and the client only the proxy. Every host has its own
shared-memory directory: the proxies get their tables over HTTP from the controller, as on real
separate hosts.

Checks: both proxies serve chats through engines of both regions on a table the controller
published; an engine of another host is not reachable through loopback (the hops are real);
after the controller is SIGKILLed the proxies keep serving on their last table (no request lost)
and report its age. Skipped with the reason where the machine does not permit namespaces.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from netns_fleet import (
    CONTROLLER_PORT,
    ENGINE_PORT,
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
from fastroute.testing.netns import Topology

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    run_dir = tmp_path_factory.mktemp("netns")
    with Topology() as topo:
        hosts = {name: topo.add_host(name) for name in ("ctl", *REGIONS, "client")}
        procs: dict[str, subprocess.Popen[bytes]] = {}
        ctl = hosts["ctl"]
        procs["controller"] = start_controller(ctl, fleet_toml(hosts, "east", ctl), run_dir)
        for region in REGIONS:
            procs |= start_region(hosts[region], fleet_toml(hosts, region, ctl), run_dir)
        urls = [hosts[r].url(ENGINE_PORT + i) + "/health" for r in REGIONS for i in range(2)]
        urls += [hosts[r].url(PROXY_PORT) + "/ready" for r in REGIONS]
        urls.append(hosts["ctl"].url(CONTROLLER_PORT) + "/health")
        ready = client(hosts["client"], "wait", *urls)
        logs = {p.name: p.read_text()[-1500:] for p in run_dir.glob("*.log")}
        assert ready["ready"], f"not ready: {ready['pending']}; logs: {logs}"
        yield {"hosts": hosts, "procs": procs}


def test_both_regions_serve_on_the_controllers_table(fleet: dict[str, Any]) -> None:
    f = fleet
    hosts = f["hosts"]
    for region in REGIONS:
        out = client(hosts["client"], "chat", hosts[region].url(PROXY_PORT), MODEL, "12")
        assert out["ok"] == 12, out["failures"]
        assert set(out["engines"]) <= {f"{r}-{i}" for r in REGIONS for i in range(2)}
        generation = metric(hosts[region], hosts["client"], "fastroute_proxy_table_generation")
        assert generation is not None and generation >= 1, "the proxy has no controller table"
    plan = client(hosts["client"], "get", hosts["ctl"].url(CONTROLLER_PORT) + "/v1/plan")
    assert plan["status"] == 200
    for engine in (f"{r}-{i}" for r in REGIONS for i in range(2)):  # scraped across the bridge
        assert f'"{engine}"' in str(plan["body"]), f"{engine} is not in the plan"


def test_engines_are_not_reachable_through_loopback_from_another_host(
    fleet: dict[str, Any],
) -> None:
    f = fleet
    hosts = f["hosts"]
    # the west engine listens on west's address: from east, loopback holds nothing
    assert client(hosts["east"], "refused", f"http://127.0.0.1:{ENGINE_PORT}/health")["refused"]
    reached = client(hosts["east"], "get", hosts["west"].url(ENGINE_PORT) + "/health")
    assert reached["status"] == 200


def test_proxies_keep_serving_when_the_controller_dies(fleet: dict[str, Any]) -> None:
    f = fleet
    hosts, procs = f["hosts"], f["procs"]
    kill_group(procs["controller"], timeout_s=10.0)
    for region in REGIONS:
        out = client(hosts["client"], "chat", hosts[region].url(PROXY_PORT), MODEL, "8")
        assert out["ok"] == 8, out["failures"]  # no request lost
        age = metric(hosts[region], hosts["client"], "fastroute_proxy_table_age_seconds")
        assert age is not None and age > 0.0


def test_a_topology_removes_every_namespace_it_made() -> None:
    topo = Topology()
    try:
        topo.add_host("a")
        with pytest.raises(ValueError, match="exists already"):
            topo.add_host("a")
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"{topo.tag}-a" in listed and f"{topo.tag}-fabric" in listed
    finally:
        topo.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert topo.tag not in listed
