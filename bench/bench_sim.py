"""Headline simulator figures: events/s on one core, 100 000 requests on 32 engines.

    python bench/bench_sim.py                 # both figures
    python bench/bench_sim.py --only events   # or: --only scale

``events`` counts every simulated engine step (fast-forwarded ones included) plus every
other event (arrivals, responses, control, pulls); ``heap`` counts only the events that
went through the heap. Runs are sequential on one core; the machine may be shared, so
repeat and compare side by side rather than trusting one number.
"""

from __future__ import annotations

import argparse
import time

from fastroute.sim import Simulator, summarize
from fastroute.sim.scenario import scenario_from_dict


def events_scenario() -> dict:
    """8 H100s, 600 s of multi-turn chat at 2 sessions/s (the prototype's first row)."""
    return {
        "name": "bench-events",
        "duration_s": 600.0,
        "drain_s": 120.0,
        "engines": [{"name": "h100", "count": 8, "capacity_rps": 10.0}],
        "workload": {"rate_sessions_per_s": 2.0, "mean_turns": 4.0, "think_time_s": 10.0},
        "control": {"optimiser": "static"},
    }


def scale_scenario() -> dict:
    """32 H100s in 4 regions, LP in the loop, sized for ~100 000 requests."""
    regions = ["r0", "r1", "r2", "r3"]
    return {
        "name": "bench-scale",
        "duration_s": 600.0,
        "drain_s": 120.0,
        "regions": [{"name": r} for r in regions],
        "engines": [
            {"name": f"{r}-h100", "count": 8, "region": r, "capacity_rps": 10.0} for r in regions
        ],
        "workload": {
            "rate_sessions_per_s": 42.0,
            "mean_turns": 4.0,
            "think_time_s": 10.0,
            "sources": [{"name": r} for r in regions],
        },
        "control": {"optimiser": "lp", "period_s": 5.0},
    }


def run(data: dict, fast_forward: bool = True) -> None:
    scenario = scenario_from_dict(data)
    t0 = time.perf_counter()
    sim = Simulator(scenario, seed=1, fast_forward=fast_forward)
    setup = time.perf_counter() - t0
    c0 = time.process_time()
    r = sim.run()
    cpu = time.process_time() - c0
    o = summarize(r.records)["overall"]
    print(
        f"{scenario.name} (fast_forward={fast_forward}): {len(r.records)} requests "
        f"({o['ok']} ok), {len(sim.engines)} engines, {r.horizon_s:.0f} s simulated; "
        f"setup {setup:.1f} s + run {r.wall_s:.1f} s wall ({cpu:.1f} s CPU); "
        f"{r.events} events ({r.steps} engine steps, {r.heap_events} via the heap): "
        f"{r.events / r.wall_s:,.0f} events/s, {r.heap_events / r.wall_s:,.0f} heap events/s, "
        f"{r.horizon_s / r.wall_s:.0f}x real time"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["events", "scale"])
    args = parser.parse_args()
    if args.only in (None, "events"):
        run(events_scenario(), fast_forward=True)
        run(events_scenario(), fast_forward=False)
    if args.only in (None, "scale"):
        run(scale_scenario(), fast_forward=True)


if __name__ == "__main__":
    main()
