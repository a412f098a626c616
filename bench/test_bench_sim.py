"""Simulator speed: events per wall second with and without decode fast-forward.

Small sizes so ``pytest bench --benchmark-disable`` stays fast; the headline figures
(events/s on one core, 100 000 requests over 32 engines) come from ``bench/bench_sim.py``.
Each round builds a fresh simulator (untimed) and times :meth:`Simulator.run`.
"""

from __future__ import annotations

import pytest

from fastroute.sim import Simulator
from fastroute.sim.scenario import scenario_from_dict

SCENARIO = {
    "name": "bench-small",
    "duration_s": 60.0,
    "drain_s": 60.0,
    "engines": [{"name": "h100", "count": 4, "capacity_rps": 10.0}],
    "workload": {"rate_sessions_per_s": 4.0, "mean_turns": 3.0, "think_time_s": 5.0},
    "control": {"optimiser": "static"},
}


@pytest.mark.parametrize("fast_forward", [True, False], ids=["ff", "step-by-step"])
def test_sim_run(benchmark, fast_forward):
    """One minute of 4 engines at ~12 req/s; extra_info carries events and steps per second."""
    scenario = scenario_from_dict(SCENARIO)

    def setup():
        return (Simulator(scenario, seed=1, fast_forward=fast_forward),), {}

    result = benchmark.pedantic(lambda sim: sim.run(), setup=setup, rounds=3, iterations=1)
    assert result.records and all(
        r.outcome == "ok" or r.reason == "unfinished" for r in result.records
    )
    benchmark.extra_info["events"] = result.events
    benchmark.extra_info["heap_events"] = result.heap_events
    benchmark.extra_info["engine_steps"] = result.steps
    benchmark.extra_info["events_per_s"] = result.events / result.wall_s
