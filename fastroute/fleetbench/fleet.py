"""The emulated fleet of the demo and the benchmark: spec, port plan, runner process.

:class:`FleetSpec` (TOML-decodable) declares regions, the RTT matrix and groups of
identical engines. :func:`plan_engines` gives every engine a name, a free loopback
port and a seed; :func:`fleet_command` is the command line of one process running all
of them (``python -m fastroute.fleetbench.fleet PLAN.json``: an
:class:`~fastroute.emulator.server.EmulatedFleet` that serves until SIGTERM/SIGINT).
One process keeps start-up short and the emulator's CPU in one place.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from fastroute.emulator.profiles import true_profile
from fastroute.fleetbench.process import free_port
from fastroute.hardware import PROFILES

__all__ = [
    "RegionSpec",
    "EngineGroup",
    "FleetSpec",
    "PlannedEngine",
    "plan_engines",
    "write_plan",
    "fleet_command",
    "set_fault",
]

_OPTS = {"frozen": True, "kw_only": True, "forbid_unknown_fields": True}
Name = Annotated[
    str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
]


class RegionSpec(msgspec.Struct, **_OPTS):
    """A region (cluster) and its residency zone."""

    name: Name
    zone: Name = "default"


class EngineGroup(msgspec.Struct, **_OPTS):
    """``count`` identical engines, named ``{name}-0 … {name}-{count-1}``.

    Attributes
    ----------
    name : str
        Name prefix, unique in the fleet.
    count : int
        Engines in the group.
    profile : str
        Emulator hardware profile, a key of
        :data:`~fastroute.hardware.PROFILES` (``"a40"``, ``"a40-qwen2.5-3b"``,
        …); also the config's ``hardware`` label, so the proxy's calibration starts
        from this profile's datasheet constants.
    step_time_factors : table of str to float
        The engines' true step times: the profile's coefficients (``a0_s`` … ``b2_s``)
        scaled by these (:func:`~fastroute.emulator.profiles.true_profile`). The
        router is not told (it sees only the ``hardware`` label).
    hardware : str
        The label the router knows the engines by (the config's ``hardware``); default
        (empty): ``profile``. A label naming no built-in profile (an operator's own,
        ``"a40-48g"``) starts the proxy's marginal-cost calibration from the default
        type's constants: the "unprofiled" start of experiment (h).
    model : str
        The served model name.
    region : str
        A declared region.
    role : {"both", "prefill", "decode"}
    capacity_rps : float
        Nominal capacity per engine at the workload's mix, req/s: the fastroute config's
        ``capacity_rps`` and the unit of the benchmark's target load.
    max_num_seqs : int
        Emulated scheduler's running-request cap.
    """

    name: Name
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[^\s*\"]+$")]
    region: Name
    count: Annotated[int, msgspec.Meta(ge=1, le=256)] = 1
    profile: str = "a40"
    step_time_factors: dict[str, float] = {}
    hardware: Annotated[str, msgspec.Meta(max_length=64, pattern=r"^([A-Za-z0-9._-]+)?$")] = ""
    role: Literal["both", "prefill", "decode"] = "both"
    capacity_rps: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    max_num_seqs: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 256

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise ValueError(
                f"engine group {self.name!r}: unknown profile {self.profile!r}; "
                f"one of {sorted(PROFILES)}"
            )
        try:
            true_profile(PROFILES[self.profile], self.step_time_factors)
        except ValueError as exc:
            raise ValueError(f"engine group {self.name!r}: step_time_factors: {exc}") from None


class FleetSpec(msgspec.Struct, **_OPTS):
    """Regions, RTTs between them (ms, fastroute's ``network.rtt_ms``) and engine groups."""

    regions: Annotated[tuple[RegionSpec, ...], msgspec.Meta(min_length=1)]
    groups: Annotated[tuple[EngineGroup, ...], msgspec.Meta(min_length=1)]
    rtt_ms: dict[str, dict[str, float]] = {}

    def __post_init__(self) -> None:
        regions = [r.name for r in self.regions]
        if len(set(regions)) != len(regions):
            raise ValueError(f"duplicate region names in {regions}")
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate engine group names in {names}")
        for g in self.groups:
            if g.region not in regions:
                raise ValueError(f"engine group {g.name!r}: region {g.region!r} not in {regions}")

    @property
    def models(self) -> tuple[str, ...]:
        """Served models, in first-appearance order."""
        return tuple(dict.fromkeys(g.model for g in self.groups))

    def capacity_rps(self, model: str | None = None) -> float:
        """Nominal capacity of the fleet (for ``model``), req/s.

        Per model: Σ of its ``both`` engines plus, when it is served disaggregated, the
        smaller of its prefill and decode pools' Σ (a request uses one engine of each;
        the simulator's pool capacity, ``fastroute.sim.core``).
        """
        total = 0.0
        for m in self.models:
            if model not in (None, m):
                continue
            by_role = {"both": 0.0, "prefill": 0.0, "decode": 0.0}
            for g in self.groups:
                if g.model == m:
                    by_role[g.role] += g.count * g.capacity_rps
            total += by_role["both"] + min(by_role["prefill"], by_role["decode"])
        return total


class PlannedEngine(msgspec.Struct, frozen=True, kw_only=True):
    """One engine with its address: what the runner starts and the config lists."""

    name: str
    model: str
    profile: str
    region: str
    role: str
    capacity_rps: float
    max_num_seqs: int
    port: int
    seed: int
    host: str = "127.0.0.1"
    step_time_factors: dict[str, float] = {}
    hardware: str = ""

    @property
    def hardware_label(self) -> str:
        """What the router's config calls the engine's hardware (default: the profile)."""
        return self.hardware or self.profile

    @property
    def url(self) -> str:
        """Server root, ``http://host:port``."""
        return f"http://{self.host}:{self.port}"


def plan_engines(fleet: FleetSpec, *, seed: int = 0) -> list[PlannedEngine]:
    """Name every engine, give it a free loopback port and a seed (``seed + index``).

    The ports are distinct: a port is free only until someone binds it, and nothing binds
    these before the fleet starts, so the kernel can hand the same one out twice (seen in CI).
    """
    out: list[PlannedEngine] = []
    taken: set[int] = set()
    for group in fleet.groups:
        for i in range(group.count):
            port = free_port()
            while port in taken:
                port = free_port()
            taken.add(port)
            out.append(
                PlannedEngine(
                    name=f"{group.name}-{i}",
                    model=group.model,
                    profile=group.profile,
                    step_time_factors=dict(group.step_time_factors),
                    hardware=group.hardware,
                    region=group.region,
                    role=group.role,
                    capacity_rps=group.capacity_rps,
                    max_num_seqs=group.max_num_seqs,
                    port=port,
                    seed=seed + len(out),
                )
            )
    return out


def write_plan(engines: Sequence[PlannedEngine], path: Path) -> Path:
    """Write the plan the runner reads; return ``path``."""
    path.write_bytes(msgspec.json.encode(list(engines)))
    return path


def fleet_command(plan_path: Path) -> list[str]:
    """The command line running the planned engines in one process."""
    return [sys.executable, "-m", "fastroute.fleetbench.fleet", str(plan_path)]


async def set_fault(
    url: str, changes: Mapping[str, object], timeout_s: float = 5.0
) -> dict[str, object]:
    """``POST /admin/fault`` with ``changes`` on an emulated engine; return its fault state.

    Raises
    ------
    RuntimeError
        The engine refused the update (the message carries its answer).
    """
    import aiohttp

    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http,
        http.post(url.rstrip("/") + "/admin/fault", json=dict(changes)) as resp,
    ):
        text = await resp.text()
        if resp.status != 200:
            raise RuntimeError(f"fault update {changes} on {url} failed: {resp.status} {text}")
        return dict(json.loads(text))


# -- the runner process -------------------------------------------------------------------------
def _specs(engines: list[PlannedEngine]) -> list:
    from fastroute.emulator.model import EngineConfig
    from fastroute.emulator.server import EngineSpec

    return [
        EngineSpec(
            name=e.name,
            model_name=e.model,
            profile=e.profile,
            step_time_factors=dict(e.step_time_factors),
            role=e.role,
            region=e.region,
            seed=e.seed,
            host=e.host,
            port=e.port,
            config=EngineConfig(max_num_seqs=e.max_num_seqs),
        )
        for e in engines
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the engines of a plan file until SIGTERM/SIGINT."""
    parser = argparse.ArgumentParser(description="run planned emulated engines")
    parser.add_argument("plan", type=Path, help="JSON plan written by write_plan")
    args = parser.parse_args(argv)
    try:
        engines = msgspec.json.decode(args.plan.read_bytes(), type=list[PlannedEngine])
    except (OSError, msgspec.DecodeError) as exc:
        print(f"fastroute.fleetbench.fleet: {args.plan}: {exc}", file=sys.stderr)
        return 2
    import logging

    import uvloop

    from fastroute.emulator.cli import serve_fleet

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    try:
        uvloop.run(serve_fleet(_specs(engines)))
    except OSError as exc:
        print(f"fastroute.fleetbench.fleet: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
