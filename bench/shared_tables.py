"""What sharing prefix-hrw's learned tables between workers buys (simulator).

    python bench/shared_tables.py                                  # bursts, 8 x 1, 4 seeds
    python bench/shared_tables.py --family prefix-tree --workers 4 --modes apart,log
    python bench/shared_tables.py --workers 4 --proxies 2 --modes no-exchange,log,fleet-log
    python bench/shared_tables.py --workers 1 --proxies 1 --modes apart     # the reference
    python bench/shared_tables.py --family bursts --loads 0.9 --per-seed --modes no-exchange,log
    python bench/shared_tables.py --family bursts --set dataplane.peer_poll_interval_s=0.05
    FASTROUTE_NO_EXTENSIONS=1 python bench/shared_tables.py --modes apart,seen,hot,both

Every worker of a proxy keeps its own ``prefix-hrw`` state: the seen table (the cost
spill's saving) and the share table (hot groups). This runs a family at ``--workers`` ×
``--proxies`` with that state fed in one of these ways, and prints goodput (req/s meeting
both SLOs) and the engines' prefix-hit rate, means over seeds, per load and mode:

``apart``      each worker learns from its own requests (``dataplane.key_log_entries = 0``);
``log``        the workers of a proxy share the host's key log, and the proxies' polls
               exchange their own entries (the default);
``no-exchange``  the host's key log, not exchanged (``dataplane.peer_key_exchange = false``);
``fleet-log``  one key log for every worker of every proxy, no delay (an upper bound on
               sharing across proxies);
``seen``, ``hot``, ``both``  the workers' tables apart, but one seen table, one share
               table or both the same objects for all of them (the diagnosis before the
               key log existed). These replace the tables of the pure-Python twin
               (``fastroute._core.prefix_py``; the compiled ones are read-only), hence
               ``FASTROUTE_NO_EXTENSIONS=1``; its decisions are the compiled core's (the
               parity tests).

docs/fleet-benchmark.md, "Several workers" and "Several proxies", quotes its output.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MODES = ("apart", "log", "no-exchange", "fleet-log", "seen", "hot", "both")
TWIN_MODES = ("seen", "hot", "both")
#: Writer ids of the fleet-wide log, clear of the dataplane indices of the proxies' own.
_FLEET_WRITER_BASE = 1 << 20


def run_mode(
    family: str,
    load: float,
    seed: int,
    workers: int,
    mode: str,
    proxies: int = 1,
    extra: dict[str, Any] | None = None,
) -> tuple[float, float]:
    """Goodput (req/s) and prefix-hit rate of one simulator run, tables fed per ``mode``
    (``extra``: more scenario settings)."""
    from fastroute.policy.prefix_hrw import private_key_log
    from fastroute.sim import Simulator, summarize
    from fastroute.sim.scenario import load_scenario

    settings = {
        "target_load": load,
        "dataplane.workers": workers,
        "dataplane.proxies": proxies,
        "dataplane.key_log_entries": 4096 if mode in ("log", "no-exchange", "fleet-log") else 0,
        "dataplane.peer_key_exchange": mode == "log",
        **(extra or {}),
    }
    scenario = load_scenario(REPO / "examples/scenarios/families" / f"{family}.toml", settings)
    sim = Simulator(scenario, policy="prefix-hrw", seed=seed)
    if mode == "fleet-log":
        log = private_key_log(4096)
        for dp in sim.dataplanes:  # replaces the proxy's own log
            dp.policy.attach_key_log(log, _FLEET_WRITER_BASE + dp.index, 0)
    elif mode in TWIN_MODES:
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
    return float(overall["goodput_rps"]), float(overall["prefix_hit_rate"] or 0.0)


def main(argv: Sequence[str] | None = None) -> int:
    """Run every load × mode × seed and print the table; 2 when a twin mode lacks the twin."""
    from fastroute._env import NO_EXTENSIONS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="bursts")
    ap.add_argument("--loads", type=lambda s: [float(x) for x in s.split(",")], default=[0.7, 0.9])
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--proxies", type=int, default=1)
    ap.add_argument("--modes", type=lambda s: s.split(","), default=["apart", "log"])
    ap.add_argument(
        "--per-seed", action="store_true", help="also print each seed's goodput (prefix hit)"
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="scenario setting for every run (repeatable), e.g. dataplane.key_log_entries=0",
    )
    args = ap.parse_args(argv)
    from fastroute.sim.scenario import ScenarioError, parse_setting

    try:
        extra = dict(parse_setting(text) for text in args.set)
    except ScenarioError as exc:
        ap.error(str(exc))
    bad = [m for m in args.modes if m not in MODES]
    if bad or args.seeds < 1 or args.workers < 1 or args.proxies < 1:
        ap.error(f"modes from {MODES} (got {bad}), --seeds, --workers, --proxies >= 1")
    if not NO_EXTENSIONS and any(m in TWIN_MODES for m in args.modes):
        print(
            f"set FASTROUTE_NO_EXTENSIONS=1 for {TWIN_MODES}: the compiled tables are read-only",
            file=sys.stderr,
        )
        return 2
    loads = " | ".join(f"load {x:g}" for x in args.loads)
    settings = "".join(f", {text}" for text in args.set)
    print(
        f"| {args.family}, {args.workers} × {args.proxies}{settings}: req/s (prefix hit) "
        f"| {loads} |"
    )
    print("|---" * (len(args.loads) + 1) + "|")
    for mode in args.modes:
        cells = []
        for load in args.loads:
            seeds = range(1, args.seeds + 1)
            runs = [
                run_mode(args.family, load, s, args.workers, mode, args.proxies, extra)
                for s in seeds
            ]
            goodput_rps = sum(g for g, _ in runs) / len(runs)
            hit = sum(h for _, h in runs) / len(runs)
            cell = f"{goodput_rps:.3f} ({hit:.1%})"
            if args.per_seed:
                cell += "; seeds " + ", ".join(f"{g:.3f} ({h:.1%})" for g, h in runs)
            cells.append(cell)
        print(f"| {mode} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
