"""Shared pieces of the namespace-topology tests: the fleet's config text, the processes a
host runs, and the client run inside a host (``netns_client.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from fastroute.testing.netns import Host, env_without_proxies

MODEL = "netns-8b"
CLIENT = str(Path(__file__).with_name("netns_client.py"))
#: Fixed ports are safe: each namespace has a port space of its own (see fastroute.testing.netns).
ENGINE_PORT, PROXY_PORT, CONTROLLER_PORT = 9100, 8000, 8090
ETCD_CLIENT_PORT, ETCD_PEER_PORT = 2379, 2380
REGIONS = ("east", "west")
FASTROUTE = [sys.executable, "-m", "fastroute", "--log-level", "WARNING"]


def fleet_toml(hosts: dict[str, Host], region: str, controller: Host, proxy: str = "") -> str:
    """The deployment's config as the proxy of ``region`` (or a controller) reads it: two
    engines per region, the controller ``controller`` and ``proxy`` added to ``[proxy]``."""
    engines = [
        f'[[engines]]\nname = "{r}-{i}"\nurl = "{hosts[r].url(ENGINE_PORT + i)}"\n'
        f'models = ["{MODEL}"]\nregion = "{r}"\nhardware = "h100"\ncapacity_rps = 10.0\n'
        for r in REGIONS
        for i in range(2)
    ]
    return (
        "\n".join(engines)
        + '\n[[network.regions]]\nname = "east"\n\n[[network.regions]]\nname = "west"\n\n'
        + "[network.rtt_ms]\neast = { west = 80.0 }\n\n"
        + f'[controller]\nhost = "{controller.address}"\nport = {CONTROLLER_PORT}\n'
        + "period_s = 0.5\nsolve_time_limit_s = 0.3\nscrape_interval_s = 0.5\n"
        + "scrape_timeout_s = 0.4\n\n"
        + f'[proxy]\nhost = "{hosts[region].address}"\nport = {PROXY_PORT}\ncluster = "{region}"\n'
        + f'controller_url = "{controller.url(CONTROLLER_PORT)}"\nreport_interval_s = 0.5\n'
        + proxy
    )


def host_env(host: Host, run_dir: Path) -> dict[str, str]:
    """A host's environment: its own shared-memory directory (hosts share no memory)."""
    shm = run_dir / f"shm-{host.name}"
    shm.mkdir(exist_ok=True)
    return env_without_proxies() | {"PYTHONUNBUFFERED": "1", "FASTROUTE_SHM_DIR": str(shm)}


def start_region(host: Host, config: str, run_dir: Path) -> dict[str, subprocess.Popen[bytes]]:
    """A region host's two emulated engines and its proxy."""
    env, path = host_env(host, run_dir), run_dir / f"{host.name}.toml"
    path.write_text(config)
    engines = host.popen(
        [*FASTROUTE, "engine", "--count", "2", "--host", host.address, "--base-port",
         str(ENGINE_PORT), "--profile", "h100", "--model", MODEL],
        env=env, log=run_dir / f"engines-{host.name}.log",
    )  # fmt: skip
    proxy = host.popen(
        [*FASTROUTE, "serve", "--config", str(path)], env=env, log=run_dir / f"{host.name}.log"
    )
    return {f"engines-{host.name}": engines, f"proxy-{host.name}": proxy}


def start_controller(host: Host, config: str, run_dir: Path) -> subprocess.Popen[bytes]:
    """A controller on ``host``."""
    path = run_dir / f"{host.name}.toml"
    path.write_text(config)
    return host.popen(
        [*FASTROUTE, "controller", "--config", str(path)],
        env=host_env(host, run_dir), log=run_dir / f"{host.name}.log",
    )  # fmt: skip


def client(host: Host, *args: str, timeout_s: float = 120.0) -> dict[str, object]:
    """Run ``netns_client.py ARGS`` inside ``host``; its JSON answer."""
    done = host.run([sys.executable, CLIENT, *args], env=env_without_proxies(), timeout_s=timeout_s)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def metric(host: Host, client_host: Host, sample: str) -> float | None:
    """The value of ``sample`` (no labels) on the proxy of ``host``, read from ``client_host``."""
    body = client(client_host, "get", host.url(PROXY_PORT) + "/metrics")["body"]
    for line in str(body).splitlines():
        if line.startswith((sample + " ", sample + "{")):
            return float(line.rsplit(" ", 1)[1])
    return None
