"""Which of prefix-hrw's per-worker tables costs a family at several workers (simulator).

    FASTROUTE_NO_EXTENSIONS=1 python bench/shared_tables.py                  # bursts, 4 seeds
    FASTROUTE_NO_EXTENSIONS=1 python bench/shared_tables.py --family rag --loads 0.9

Every worker of a proxy keeps its own ``prefix-hrw`` state: the seen table (the cost
spill's saving) and the share table (hot groups). With ``W`` workers each sees ``1/W`` of
the traffic. This runs the family at ``--workers`` workers × 1 proxy (one shared load view,
so only the policy state differs from 1 × 1) with the workers' tables kept apart
(``none``), or one seen table, one share table or both shared by all of them, and prints
goodput (req/s meeting both SLOs, mean over seeds) per load and mode. Sharing replaces the
tables of the pure-Python twin (``fastroute._core.prefix_py``; the compiled ones are
read-only), hence ``FASTROUTE_NO_EXTENSIONS=1``; its decisions are the compiled core's
(the parity tests), so ``none`` matches ``bench/policy_matrix.py --configs 8x1``.
docs/fleet-benchmark.md, "Several proxies", quotes its output for ``bursts``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODES = ("none", "seen", "hot", "both")


def run_mode(family: str, load: float, seed: int, workers: int, mode: str) -> float:
    """Goodput (req/s) of one simulator run with the workers' tables shared per ``mode``."""
    from fastroute.sim import Simulator, summarize
    from fastroute.sim.scenario import load_scenario

    settings = {"target_load": load, "dataplane.workers": workers, "dataplane.proxies": 1}
    scenario = load_scenario(REPO / "examples/scenarios/families" / f"{family}.toml", settings)
    sim = Simulator(scenario, policy="prefix-hrw", seed=seed)
    first = sim.dataplanes[0].policy._picker  # type: ignore[attr-defined]
    for dp in sim.dataplanes[1:]:
        picker = dp.policy._picker  # type: ignore[attr-defined]
        if mode in ("seen", "both"):
            picker.seen = first.seen
        if mode in ("hot", "both"):
            picker.hot = first.hot
    result = sim.run()
    window_s = scenario.duration_s - scenario.warmup_s
    overall = summarize(result.records, slo=scenario.slo, duration_s=window_s)["overall"]
    return float(overall["goodput_rps"])


def main(argv: Sequence[str] | None = None) -> int:
    """Run every load × mode × seed and print the table; 2 without the pure-Python core."""
    from fastroute._env import NO_EXTENSIONS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="bursts")
    ap.add_argument("--loads", type=lambda s: [float(x) for x in s.split(",")], default=[0.7, 0.9])
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES))
    args = ap.parse_args(argv)
    if not NO_EXTENSIONS:
        print("set FASTROUTE_NO_EXTENSIONS=1: the compiled tables are read-only", file=sys.stderr)
        return 2
    bad = [m for m in args.modes if m not in MODES]
    if bad or args.seeds < 1 or args.workers < 2:
        ap.error(f"modes from {MODES} (got {bad}), --seeds >= 1, --workers >= 2")
    loads = " | ".join(f"load {x:g}" for x in args.loads)
    print(f"| {args.family}, {args.workers} × 1 | {loads} |")
    print("|---" * (len(args.loads) + 1) + "|")
    for mode in args.modes:
        cells = []
        for load in args.loads:
            seeds = range(1, args.seeds + 1)
            runs = [run_mode(args.family, load, s, args.workers, mode) for s in seeds]
            cells.append(f"{sum(runs) / len(runs):.3f}")
        print(f"| {mode} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
