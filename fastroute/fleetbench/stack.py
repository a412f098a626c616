"""Start the emulated fleet and fastroute (controller + one proxy per source cluster).

Used by ``fastroute demo`` and by the benchmark's ``fastroute`` router. Every
shared-memory segment of a run is named ``{shm_prefix}-…`` with a run-unique prefix,
so :func:`remove_segments` can delete exactly what the run created — including the
weight table, which the controller leaves in place on purpose when it stops.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fastroute.config import DEFAULT_POLICY_NAME
from fastroute.fleetbench.configgen import ProxySettings, render_config
from fastroute.fleetbench.fleet import (
    FleetSpec,
    PlannedEngine,
    fleet_command,
    plan_engines,
    write_plan,
)
from fastroute.fleetbench.process import ManagedProcess, ProcessSet, free_port, wait_http_ok

__all__ = ["run_prefix", "remove_segments", "start_fleet", "FastrouteStack", "READY_TIMEOUT_S"]

#: Bound on each server's readiness wait, seconds.
READY_TIMEOUT_S = 60.0


def run_prefix(kind: str) -> str:
    """A run-unique name prefix, e.g. ``fastroute-demo-1a2b3c4d``."""
    return f"fastroute-{kind}-{uuid.uuid4().hex[:8]}"


def remove_segments(prefix: str) -> list[str]:
    """Delete every shared-memory file whose name starts with ``prefix``; return their names."""
    from fastroute.tables.segment import shm_dir

    if not prefix.startswith("fastroute-") or len(prefix) < 16:
        raise ValueError(f"refusing to remove segments by the broad prefix {prefix!r}")
    removed = []
    for path in sorted(shm_dir().glob(prefix + "*")):
        try:
            path.unlink()
            removed.append(path.name)
        except FileNotFoundError:
            continue
    return removed


async def start_fleet(
    procs: ProcessSet, fleet: FleetSpec, run_dir: Path, *, seed: int = 0
) -> tuple[ManagedProcess, list[PlannedEngine]]:
    """Start every engine of ``fleet`` in one process; wait until each answers ``/health``."""
    engines = plan_engines(fleet, seed=seed)
    plan = write_plan(engines, run_dir / "fleet-plan.json")
    proc = procs.start("fleet", fleet_command(plan))
    await asyncio.gather(
        *(wait_http_ok(e.url + "/health", timeout_s=READY_TIMEOUT_S, process=proc) for e in engines)
    )
    return proc, engines


@dataclass
class FastrouteStack:
    """fastroute over a running fleet: the controller and the proxies of each source cluster.

    Parameters
    ----------
    procs : ProcessSet
        Where the processes are registered (and stopped).
    fleet : FleetSpec
    engines : sequence of PlannedEngine
        The running engines.
    sources : sequence of str
        Source clusters; each must be a region of ``fleet``.
    run_dir : Path
        Config files go here.
    shm_prefix : str
        Run-unique prefix of the table and stats-block names.
    policy : str
        ``policy.default`` of the proxies.
    policy_params : mapping, optional
        Its ``[policy.params.<policy>]``.
    hardware : str, optional
        The ``hardware`` label of every engine in the configs (default: their own).
    hedge : bool
        The config's classes hedge first tokens (``[[classes]] hedge``).
    period_s : float
        Controller period.
    controller_enabled : bool
        Run the controller (its LP weights and shed fractions reach the proxies). Off:
        no controller; the proxies route on their config's capacity weights and never
        shed (the simulator's ``optimiser = "static"``).
    slo_s : mapping, optional
        Model → (TTFT, TBOT) SLO seconds (config classes).
    workers : int
        ``proxy.workers`` of every proxy.
    proxies_per_source : int
        Proxies per source cluster, each with its own port and stats block and nothing
        shared but the controller's table (as on separate hosts).
    peers : bool
        With more than one proxy in the run, each lists the others as ``proxy.peers``
        (default); False: none does.
    proxy_settings : mapping, optional
        Further ``[proxy]`` keys of every proxy's config.
    log_level : str
        ``--log-level`` of the children.
    edit_config : callable, optional
        Applied to each generated config text before it is written (extra sections).
    """

    procs: ProcessSet
    fleet: FleetSpec
    engines: Sequence[PlannedEngine]
    sources: Sequence[str]
    run_dir: Path
    shm_prefix: str
    policy: str = DEFAULT_POLICY_NAME
    policy_params: Mapping[str, bool | int | float | str] | None = None
    hardware: str | None = None
    hedge: bool = False
    period_s: float = 5.0
    controller_enabled: bool = True
    slo_s: Mapping[str, tuple[float, float]] | None = None
    workers: int = 1
    proxies_per_source: int = 1
    peers: bool = True
    proxy_settings: Mapping[str, bool | int | float | str] | None = None
    log_level: str = "WARNING"
    edit_config: Callable[[str], str] | None = None
    controller: ManagedProcess | None = None
    proxies: dict[str, ManagedProcess] = field(default_factory=dict)
    #: Every proxy's base URL per source cluster.
    source_urls: dict[str, list[str]] = field(default_factory=dict)
    controller_url: str = ""
    config_paths: dict[str, Path] = field(default_factory=dict)
    _urls: dict[str, str] = field(default_factory=dict)

    @property
    def table_name(self) -> str:
        """The shared-memory weight table of this run."""
        return f"{self.shm_prefix}-weights"

    def _cmd(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "fastroute", "--log-level", self.log_level, *args]

    async def start(self) -> dict[str, str]:
        """Write the configs, start the controller (if enabled) then the proxies; return
        source → URL of its first proxy (:attr:`source_urls` has them all).

        The controller starts first and must publish before any proxy starts: a proxy's
        weights puller would otherwise take the table's writer lock.
        """
        regions = {r.name for r in self.fleet.regions}
        for source in self.sources:
            if source not in regions:
                raise ValueError(
                    f"source cluster {source!r} is not a fleet region {sorted(regions)}"
                )
        controller_port = free_port()
        if self.controller_enabled:
            self.controller_url = f"http://127.0.0.1:{controller_port}"
        ports = {
            (index, copy): free_port()
            for index in range(len(self.sources))
            for copy in range(self.proxies_per_source)
        }
        urls = {key: f"http://127.0.0.1:{port}" for key, port in ports.items()}
        for (index, copy), port in ports.items():
            peers = [u for key, u in urls.items() if key != (index, copy)] if self.peers else []
            self._write_config(index, copy, port, peers, controller_port)
        if self.controller_enabled:
            first = next(iter(self.config_paths.values()))
            self.controller = self.procs.start(
                "controller", self._cmd("controller", "--config", str(first))
            )
            await wait_http_ok(
                self.controller_url + "/health", timeout_s=READY_TIMEOUT_S, process=self.controller
            )
        for name, path in self.config_paths.items():
            self.proxies[name] = self.procs.start(
                f"proxy-{name}", self._cmd("serve", "--config", str(path))
            )
        await asyncio.gather(
            *(
                wait_http_ok(self._urls[name] + "/ready", timeout_s=READY_TIMEOUT_S, process=proc)
                for name, proc in self.proxies.items()
            )
        )
        return self.proxy_urls

    def _write_config(
        self, index: int, copy: int, port: int, peers: list[str], controller_port: int
    ) -> None:
        # one proxy: "<source>" alone, "<source>-<copy>" when a source has several
        source = self.sources[index]
        name = source if self.proxies_per_source == 1 else f"{source}-{copy}"
        stats = f"{self.shm_prefix}-stats-{index}" + ("" if copy == 0 else f"-{copy}")
        settings = ProxySettings(
            source, port, stats, workers=self.workers, peers=peers, extra=self.proxy_settings
        )
        text = render_config(
            self.fleet,
            self.engines,
            settings,
            table_name=self.table_name,
            controller_port=controller_port,
            controller_url=self.controller_url or None,
            policy=self.policy,
            policy_params=self.policy_params,
            hardware=self.hardware,
            hedge=self.hedge,
            period_s=self.period_s,
            slo_s=self.slo_s,
        )
        if self.edit_config is not None:  # e.g. tenants for bench_tenant_limits
            text = self.edit_config(text)
        path = self.run_dir / f"fastroute-{name}.toml"
        path.write_text(text)
        self.config_paths[name] = path
        url = f"http://127.0.0.1:{settings.port}"
        self._urls[name] = url
        self.source_urls.setdefault(source, []).append(url)

    @property
    def proxy_urls(self) -> dict[str, str]:
        """Source → the base URL of its first proxy."""
        return {source: urls[0] for source, urls in self.source_urls.items()}

    def proxy_url(self, name: str) -> str:
        """The base URL of proxy ``name`` (a key of :attr:`proxies`)."""
        return self._urls[name]

    @property
    def processes(self) -> list[ManagedProcess]:
        """The controller and the proxies (what the benchmark counts as the router)."""
        out = [self.controller] if self.controller is not None else []
        return out + list(self.proxies.values())
