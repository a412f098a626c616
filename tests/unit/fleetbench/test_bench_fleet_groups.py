"""Engine groups of the fleet benchmark: every emulator profile, true step times, capacity."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from fastroute.fleetbench import fleet
from fastroute.fleetbench.fleet import (
    EngineGroup,
    FleetSpec,
    PlannedEngine,
    RegionSpec,
    plan_engines,
)
from fastroute.hardware import PROFILES

FACTORS = {"a0_s": 1.5, "b0_s": 1.5, "a1_s": 0.8}


def _group(**kw: object) -> dict[str, object]:
    return {"name": "g", "model": "m", "region": "r", **kw}


def _fleet(*groups: dict[str, object]) -> FleetSpec:
    return msgspec.convert({"regions": [{"name": "r"}], "groups": list(groups)}, FleetSpec)


def test_every_emulator_profile_is_accepted_and_others_are_named() -> None:
    for name in PROFILES:
        assert msgspec.convert(_group(profile=name), EngineGroup).profile == name
    with pytest.raises(msgspec.ValidationError, match="unknown profile 'b200'"):
        msgspec.convert(_group(profile="b200"), EngineGroup)


@pytest.mark.parametrize(
    ("factors", "message"),
    [
        ({"q0_s": 1.5}, "unknown step-time coefficient 'q0_s'"),
        ({"b0_s": 0.0}, "must be a finite number > 0"),
        ({"b0_s": float("inf")}, "must be a finite number"),
    ],
)
def test_bad_step_time_factors_name_the_group(factors: dict[str, float], message: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=f"engine group 'g'.*{message}"):
        msgspec.convert(_group(step_time_factors=factors), EngineGroup)


def test_factors_reach_the_plan_file_and_the_engine_specs(tmp_path: Path) -> None:
    spec = _fleet(
        _group(name="p", profile="a40-qwen2.5-3b", role="prefill", step_time_factors=FACTORS),
        _group(name="d", profile="a40-qwen2.5-3b", role="decode", count=2),
    )
    engines = plan_engines(spec, seed=5)
    assert [dict(e.step_time_factors) for e in engines] == [FACTORS, {}, {}]
    path = fleet.write_plan(engines, tmp_path / "plan.json")
    decoded = msgspec.json.decode(path.read_bytes(), type=list[PlannedEngine])
    assert decoded == engines
    specs = fleet._specs(decoded)
    assert [dict(s.step_time_factors) for s in specs] == [FACTORS, {}, {}]
    assert [s.profile for s in specs] == ["a40-qwen2.5-3b"] * 3
    assert [s.role for s in specs] == ["prefill", "decode", "decode"]


def test_capacity_counts_a_disaggregated_pool_once() -> None:
    """Colocated engines add up; a P/D model is limited by its smaller pool."""
    spec = _fleet(
        _group(name="p", role="prefill", count=2, capacity_rps=8.0),
        _group(name="d", role="decode", count=4, capacity_rps=24.0),
        _group(name="b", role="both", count=2, capacity_rps=5.0, model="other"),
    )
    assert spec.capacity_rps() == pytest.approx(16.0 + 10.0)
    assert spec.capacity_rps("m") == pytest.approx(16.0)
    assert spec.capacity_rps("other") == pytest.approx(10.0)
    both = FleetSpec(
        regions=(RegionSpec(name="r"),),
        groups=(EngineGroup(name="x", model="m", region="r", count=3, capacity_rps=2.0),),
    )
    assert both.capacity_rps() == pytest.approx(6.0)
