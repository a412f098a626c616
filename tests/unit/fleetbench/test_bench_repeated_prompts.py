"""The repeated-prompts bench spec: the simulator scenario's requests, its capacity."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from fastroute.fleetbench.families import saturation_capacity
from fastroute.fleetbench.runner import build_sessions, target_rps
from fastroute.fleetbench.spec import load_spec
from fastroute.sim.scenario import load_scenario
from fastroute.workload.family_gen import family_sessions

REPO = Path(__file__).resolve().parents[3]
SPEC = REPO / "examples" / "bench" / "repeated-prompts-90.toml"
SCENARIO = REPO / "examples" / "scenarios" / "repeated-prompts.toml"


def test_the_bench_sends_the_scenarios_requests_at_its_capacity() -> None:
    spec = load_spec(SPEC)
    capacity = spec.fleet.groups[0].capacity_rps
    assert saturation_capacity(spec, spec.fleet.groups[0].profile) == pytest.approx(
        capacity, abs=0.01
    )
    assert not spec.send_session_id  # the proxy keys each chat by its text: one prompt, one key
    sessions, _, _ = build_sessions(spec)
    rate = 0.9 * 4 * capacity
    assert target_rps(spec) == pytest.approx(rate)
    scenario = load_scenario(SCENARIO)
    assert scenario.dataplane.routing_key == "conversation"
    same = family_sessions(
        msgspec.structs.replace(scenario.family, rate_rps=rate),
        duration_s=spec.warmup_s + spec.duration_s,
        sources=("local",),
        seed=spec.seed,
        base_dir=scenario.base_dir,
    )
    assert sessions == same and len(sessions) > 500
    # Five prompts sent again and again: 1,200 rows, and the window needs 2,025, so the
    # replay wraps round once with fresh blocks (five more prompts).
    assert len({s.turns[0].user_text for s in sessions}) == 10
