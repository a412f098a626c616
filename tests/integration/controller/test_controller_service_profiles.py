"""Online profiles in the service: reports → fitted group curves → LP costs and ``/v1/plan``.

The service runs in-process over four h100 engines (east: engine-0/1, west: engine-2/3) and the
test drives the periods with :meth:`ControllerService.step`; the signal is proxy reports fed to
:meth:`ControllerService.observe`, every engine at ρ = 0.5.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import pytest
from controller_fleet import ENGINES, FAST_DERATING, REGIONS, two_region_toml

from controller.options import ControllerOptions
from controller.service import ControllerService
from fastroute.config import decode_config
from fastroute.hashing import engine_id
from fastroute.signals.reports import EngineReport, LatencySummary, Report

pytestmark = pytest.mark.integration

ATTEMPTS = 25  # per 5 s window on 10 req/s engines: ρ = 0.5
SEED_TTFT_S = 0.05 / (1 - 0.5)  # h100 seed at ρ = 0.5
SEED_TBOT_S = 0.008 * (1 + 0.8 * 0.5)


def run(coro: Coroutine[Any, Any, Any], timeout: float = 25.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def make_service(
    table_name: str, clock: Callable[[], float] = time.time, **options: Any
) -> ControllerService:
    toml = two_region_toml(table_name, tables=FAST_DERATING)
    options.setdefault("profile_half_life_windows", 10)
    svc = ControllerService(
        decode_config(toml, source="controller.toml"), ControllerOptions(**options), clock=clock
    )
    svc.open()
    return svc


def report(factor: dict[str, float]) -> Report:
    """One worker's 5 s window; TTFT and TBOT = seed × the engine's factor."""
    now = time.time()
    engines = []
    for name in ENGINES:
        f = factor.get(name, 1.0)
        ttft = LatencySummary(ATTEMPTS, ATTEMPTS * SEED_TTFT_S * f, 0.0, 0.0, 0.0, 0.0, [])
        tbot = LatencySummary(ATTEMPTS, ATTEMPTS * SEED_TBOT_S * f, 0.0, 0.0, 0.0, 0.0, [])
        engines.append(EngineReport(engine_id(name), ATTEMPTS, {}, ttft, tbot))
    return Report(1, "east", "w-1", now - 5.0, now, [], engines)


def test_a_slower_region_is_refitted_not_derated_and_prices_the_lp(shm_name: str) -> None:
    """West engines 1.6× slower than the h100 seed, east as seeded: the west fit group learns
    ≈1.6× (TTFT and TBOT), east stays the seed, nobody is derated, the plan shows seed vs fitted
    and sample counts, and the LP's west segment slopes are the fitted ones."""

    async def main() -> None:
        svc = make_service(shm_name)
        try:
            svc.observe(report({}))
            await svc.step()
            assert not any(p["fitted"] for p in svc.plan_json()["profiles"])  # one window
            slopes_before = [p.slopes_s.copy() for p in svc.model.groups.profiles]
            for _ in range(12):
                svc.observe(report({"engine-2": 1.6, "engine-3": 1.6}))
                await svc.step()
            plan = svc.plan_json()
        finally:
            svc.close()
        fits = {p["group"]: p for p in plan["profiles"]}
        assert set(fits) == {"h100/demo-8b/east/both", "h100/demo-8b/west/both"}
        west, east = fits["h100/demo-8b/west/both"], fits["h100/demo-8b/east/both"]
        ratio = np.divide(west["fitted_ttft_s"], west["seed_ttft_s"])
        assert west["fitted"] and np.allclose(ratio, 1.6, rtol=0.05)
        assert np.allclose(np.divide(west["fitted_tbot_s"], west["seed_tbot_s"]), 1.6, rtol=0.05)
        assert sum(west["ttft_samples"]) == 2 * 13 and west["engines"] == 2
        assert np.allclose(east["fitted_ttft_s"], east["seed_ttft_s"], rtol=0.01)
        assert plan["profile_updates_total"] >= 1
        assert all(e["derating"]["level"] == 1.0 for e in plan["engines"])
        assert {e["fit_group"] for e in plan["engines"]} == set(fits)
        # the LP prices west groups with the fitted curve: slopes 1.6× the (seeded) east ones
        groups = svc.model.groups
        region = {n: REGIONS[i // 2] for i, n in enumerate(ENGINES)}
        slopes = {
            region[ENGINES[int(m[0])]]: groups.profiles[j].slopes_s
            for j, m in enumerate(groups.members)
        }
        assert np.allclose(slopes["west"] / slopes["east"], 1.6, rtol=0.05)
        assert np.allclose(slopes["east"], slopes_before[0])

    run(main())


def test_a_stable_slowdown_is_reprofiled_instead_of_derated_forever(shm_name: str) -> None:
    """engine-0 3× slower for good: derated (0.75) at the 3rd window like any anomaly; once the
    shift has been stable for ``reprofile_after_windows`` (4) derated windows it gets its own fit
    group (seeded 3× its group), full health back, and is not derated again over the following
    windows (no flapping); the LP gives it less than its healthy twin."""

    async def main() -> tuple[list[float], dict[str, Any]]:
        svc = make_service(shm_name, reprofile_after_windows=4)
        levels: list[float] = []
        try:
            for _ in range(14):
                svc.observe(report({"engine-0": 3.0}))
                await svc.step()
                e0 = next(e for e in svc.plan_json()["engines"] if e["name"] == "engine-0")
                levels.append(e0["derating"]["level"])
            return levels, svc.plan_json()
        finally:
            svc.close()

    levels, plan = run(main())
    first_down = levels.index(0.75)
    assert first_down == 2
    back = next(i for i in range(first_down, len(levels)) if levels[i] == 1.0)
    assert back <= first_down + 4
    assert all(v == 1.0 for v in levels[back:]), levels  # stays healthy: no flapping
    assert plan["reprofiles_total"] == 1
    e0 = next(e for e in plan["engines"] if e["name"] == "engine-0")
    e1 = next(e for e in plan["engines"] if e["name"] == "engine-1")
    assert e0["fit_group"] == "h100/demo-8b/east/both+engine-0"
    assert e1["fit_group"] == "h100/demo-8b/east/both"
    assert e0["derating"]["reason"].startswith("re-profiled: stable shift (TTFT 3.00×")
    own = next(p for p in plan["profiles"] if p["group"] == e0["fit_group"])
    assert np.allclose(np.divide(own["seed_ttft_s"][:3], own["fitted_ttft_s"][:3]), 1.0, atol=0.05)
    east = next(c for c in plan["classes"] if c["name"] == "east/demo-8b/default")
    w = east["weights"]
    assert w.get("engine-0", 0.0) < 0.5 * w["engine-1"]  # priced by its own, slower curve


def test_unchanged_plans_publish_nothing_until_the_heartbeat(shm_name: str) -> None:
    """With nothing changing, periods keep the generation (no wake-ups); once the table in force
    is ``republish_after_s`` old the same weights are published again as a new generation."""
    now = [1_000.0]

    async def main() -> list[int]:
        svc = make_service(shm_name, clock=lambda: now[0], republish_after_s=2.0)
        gens = []
        try:
            for _ in range(8):
                await svc.step()
                gens.append(svc.generation)
                now[0] += 0.5
        finally:
            svc.close()
        return gens

    gens = run(main())
    # published at t = 0, unchanged at 0.5 … 1.5, republished at 2.0 (age 2 s), then quiet again
    assert gens == [1, 1, 1, 1, 2, 2, 2, 2], gens
