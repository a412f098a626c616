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

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fastroute.fleetbench.process import kill_group
from fastroute.testing.netns import Host, Topology, env_without_proxies, netns_unavailable

pytestmark = pytest.mark.integration

_REASON = netns_unavailable()
if _REASON is not None:
    pytest.skip(f"multi-host topology not possible here: {_REASON}", allow_module_level=True)

MODEL = "netns-8b"
CLIENT = str(Path(__file__).with_name("netns_client.py"))
#: Fixed ports are safe: each namespace has a port space of its own (see fastroute.testing.netns).
ENGINE_PORT, PROXY_PORT, CONTROLLER_PORT = 9100, 8000, 8090
REGIONS = ("east", "west")


def _config(hosts: dict[str, Host], region: str) -> str:
    """The deployment's config as the proxy of ``region`` (or the controller) reads it."""
    engines = []
    for r in REGIONS:
        for i in range(2):
            engines.append(
                f'[[engines]]\nname = "{r}-{i}"\nurl = "{hosts[r].url(ENGINE_PORT + i)}"\n'
                f'models = ["{MODEL}"]\nregion = "{r}"\nhardware = "h100"\ncapacity_rps = 10.0\n'
            )
    ctl = hosts["ctl"]
    return (
        "\n".join(engines)
        + '\n[[network.regions]]\nname = "east"\n\n[[network.regions]]\nname = "west"\n\n'
        + "[network.rtt_ms]\neast = { west = 80.0 }\n\n"
        + f'[controller]\nhost = "{ctl.address}"\nport = {CONTROLLER_PORT}\nperiod_s = 0.5\n'
        + "solve_time_limit_s = 0.3\nscrape_interval_s = 0.5\nscrape_timeout_s = 0.4\n\n"
        + f'[proxy]\nhost = "{hosts[region].address}"\nport = {PROXY_PORT}\ncluster = "{region}"\n'
        + f'controller_url = "{ctl.url(CONTROLLER_PORT)}"\nreport_interval_s = 0.5\n'
    )


def _client(host: Host, *args: str) -> dict[str, object]:
    done = host.run([sys.executable, CLIENT, *args], env=env_without_proxies(), timeout_s=120.0)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _start(host: Host, config: str, run_dir: Path) -> dict[str, subprocess.Popen[bytes]]:
    """The host's processes: the controller on ``ctl``; two engines and a proxy on a region."""
    shm = run_dir / f"shm-{host.name}"
    shm.mkdir()
    env = env_without_proxies() | {"PYTHONUNBUFFERED": "1", "FASTROUTE_SHM_DIR": str(shm)}
    path = run_dir / f"{host.name}.toml"
    path.write_text(config)
    fr = [sys.executable, "-m", "fastroute", "--log-level", "WARNING"]
    log = run_dir / f"{host.name}.log"
    if host.name == "ctl":
        return {
            "controller": host.popen([*fr, "controller", "--config", str(path)], env=env, log=log)
        }
    engines = host.popen(
        [*fr, "engine", "--count", "2", "--host", host.address, "--base-port", str(ENGINE_PORT),
         "--profile", "h100", "--model", MODEL],
        env=env, log=run_dir / f"engines-{host.name}.log",
    )  # fmt: skip
    proxy = host.popen([*fr, "serve", "--config", str(path)], env=env, log=log)
    return {f"engines-{host.name}": engines, f"proxy-{host.name}": proxy}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    run_dir = tmp_path_factory.mktemp("netns")
    with Topology() as topo:
        hosts = {name: topo.add_host(name) for name in ("ctl", *REGIONS, "client")}
        procs: dict[str, subprocess.Popen[bytes]] = {}
        for name in ("ctl", *REGIONS):
            procs |= _start(hosts[name], _config(hosts, "east" if name == "ctl" else name), run_dir)
        urls = [hosts[r].url(ENGINE_PORT + i) + "/health" for r in REGIONS for i in range(2)]
        urls += [hosts[r].url(PROXY_PORT) + "/ready" for r in REGIONS]
        urls.append(hosts["ctl"].url(CONTROLLER_PORT) + "/health")
        ready = _client(hosts["client"], "wait", *urls)
        logs = {p.name: p.read_text()[-1500:] for p in run_dir.glob("*.log")}
        assert ready["ready"], f"not ready: {ready['pending']}; logs: {logs}"
        yield {"hosts": hosts, "procs": procs}


def _metric(host: Host, client: Host, sample: str) -> float | None:
    body = _client(client, "get", host.url(PROXY_PORT) + "/metrics")["body"]
    for line in str(body).splitlines():
        if line.startswith(sample + " ") or line.startswith(sample + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_both_regions_serve_on_the_controllers_table(fleet: dict[str, Any]) -> None:
    f = fleet
    hosts = f["hosts"]
    for region in REGIONS:
        out = _client(hosts["client"], "chat", hosts[region].url(PROXY_PORT), MODEL, "12")
        assert out["ok"] == 12, out["failures"]
        assert set(out["engines"]) <= {f"{r}-{i}" for r in REGIONS for i in range(2)}
        generation = _metric(hosts[region], hosts["client"], "fastroute_proxy_table_generation")
        assert generation is not None and generation >= 1, "the proxy has no controller table"
    plan = _client(hosts["client"], "get", hosts["ctl"].url(CONTROLLER_PORT) + "/v1/plan")
    assert plan["status"] == 200
    for engine in (f"{r}-{i}" for r in REGIONS for i in range(2)):  # scraped across the bridge
        assert f'"{engine}"' in str(plan["body"]), f"{engine} is not in the plan"


def test_engines_are_not_reachable_through_loopback_from_another_host(
    fleet: dict[str, Any],
) -> None:
    f = fleet
    hosts = f["hosts"]
    # the west engine listens on west's address: from east, loopback holds nothing
    assert _client(hosts["east"], "refused", f"http://127.0.0.1:{ENGINE_PORT}/health")["refused"]
    reached = _client(hosts["east"], "get", hosts["west"].url(ENGINE_PORT) + "/health")
    assert reached["status"] == 200


def test_proxies_keep_serving_when_the_controller_dies(fleet: dict[str, Any]) -> None:
    f = fleet
    hosts, procs = f["hosts"], f["procs"]
    kill_group(procs["controller"], timeout_s=10.0)
    for region in REGIONS:
        out = _client(hosts["client"], "chat", hosts[region].url(PROXY_PORT), MODEL, "8")
        assert out["ok"] == 8, out["failures"]  # no request lost
        age = _metric(hosts[region], hosts["client"], "fastroute_proxy_table_age_seconds")
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
