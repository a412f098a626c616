"""``fastroute sim``: run a scenario, or compare policies / variants side by side.

::

    fastroute sim run SCENARIO.toml --policy NAME --seed S --out DIR [--set KEY=VALUE ...]
    fastroute sim compare SCENARIO.toml --policies a,b,c --seed S --out DIR
    fastroute sim sweep EXPERIMENT.toml --out DIR [--seeds 1,2,3] [--set KEY=VALUE ...]

``compare`` runs one arm per policy, or, when the scenario has ``[[variants]]``, one
arm per variant (times each policy, if ``--policies`` is given too). Each arm writes a
run directory; the comparison writes ``report.md`` and ``metrics.json`` on top.
``sweep`` runs a grid of cases × arms × seeds (:mod:`fastroute.sim.sweep`).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``fastroute sim`` arguments."""
    sub = parser.add_subparsers(dest="sim_command", metavar="ACTION", required=True)
    for name, helptext in (
        ("run", "simulate one scenario with one policy"),
        ("compare", "simulate one scenario with several policies or variants"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("scenario", help="scenario TOML file (see examples/scenarios/)")
        if name == "run":
            p.add_argument("--policy", help="routing policy (default: the scenario's)")
        else:
            p.add_argument(
                "--policies", help="comma-separated policies (default: the scenario's variants)"
            )
        p.add_argument("--seed", type=int, help="seed (default: the scenario's)")
        p.add_argument("--out", required=True, help="output directory")
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a scenario key, e.g. --set target_load=0.8 "
            "--set control.optimiser=lp (value in TOML syntax)",
        )
        p.add_argument(
            "--no-fast-forward",
            action="store_true",
            help="step every decode step (for checking; slower)",
        )
        p.add_argument("--quiet", action="store_true", help="no progress bar")
    p = sub.add_parser("sweep", help="run a grid of cases x arms x seeds (an experiment file)")
    p.add_argument(
        "experiment", help="experiment TOML file (e.g. examples/scenarios/pd-experiment.toml)"
    )
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seeds", help="comma-separated seeds (default: the file's)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key of the base scenario, e.g. --set duration_s=60",
    )
    p.add_argument("--quiet", action="store_true", help="no per-run lines")


class _Progress:
    """Progress on stderr: a redrawn bar on a terminal, a line every 5 s otherwise."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label = label
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self.last_line = self.t0

    def __call__(self, now_s: float, horizon_s: float, events: int) -> None:
        if not self.enabled:
            return
        frac = min(1.0, now_s / horizon_s) if horizon_s > 0 else 1.0
        wall = time.perf_counter() - self.t0
        done = frac >= 1.0 or now_s >= horizon_s
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        text = (
            f"{self.label} [{bar}] {100 * frac:5.1f}%  t={now_s:8.1f}/{horizon_s:.0f} s  "
            f"{events / 1e3:9.1f}k events  {wall:6.1f} s"
        )
        if self.tty:
            sys.stderr.write("\r" + text + ("\n" if done else ""))
        elif done or wall - (self.last_line - self.t0) >= 5.0:
            self.last_line = time.perf_counter()
            sys.stderr.write(text + "\n")
        sys.stderr.flush()


def _settings(items: list[str]) -> dict[str, Any]:
    from fastroute.sim.scenario import parse_setting

    return dict(parse_setting(item) for item in items)


def _one(
    scenario: Any, policy: str | None, seed: int | None, out: str, args: argparse.Namespace
) -> tuple[str, dict[str, Any]]:
    from fastroute.sim.core import Simulator
    from fastroute.sim.report import write_run

    sim = Simulator(
        scenario,
        policy=policy,
        seed=seed,
        fast_forward=not args.no_fast_forward,
        progress=_Progress(
            f"{scenario.name}/{policy or scenario.dataplane.policy}", not args.quiet
        ),
    )
    result = sim.run()
    metrics = write_run(result, sim.scenario, out, policy=sim.policy_name, seed=sim.seed)
    return sim.policy_name, metrics


def _sweep(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fastroute.policy import PolicyConfigError
    from fastroute.sim.sweep import run_sweep
    from fastroute.workload import WorkloadError

    try:
        seeds = tuple(int(s) for s in args.seeds.split(",") if s) if args.seeds else None
    except ValueError:
        print(f"fastroute sim: --seeds must be integers, got {args.seeds!r}", file=sys.stderr)
        return 2
    say = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    try:
        run_sweep(
            args.experiment, args.out, seeds=seeds, settings=_settings(args.set), progress=say
        )
    except (WorkloadError, PolicyConfigError, ValueError) as exc:
        print(f"fastroute sim: {exc}", file=sys.stderr)
        return 2
    print((Path(args.out) / "report.md").read_text(), end="")
    return 0


def run(args: argparse.Namespace) -> int:
    """Execute ``fastroute sim``; return the exit status."""
    from pathlib import Path

    from fastroute.policy import PolicyConfigError
    from fastroute.sim.report import matplotlib_or_none, write_comparison
    from fastroute.sim.scenario import (
        apply_settings,
        load_scenario_dict,
        scenario_from_dict,
    )
    from fastroute.workload import WorkloadError

    if args.sim_command == "sweep":
        return _sweep(args)
    try:
        base = apply_settings(load_scenario_dict(args.scenario), _settings(args.set))
        scenario = scenario_from_dict(base, args.scenario)
        if matplotlib_or_none() is None and not args.quiet:
            print("fastroute sim: matplotlib is not installed; plots are skipped", file=sys.stderr)
        if args.sim_command == "run":
            _, m = _one(scenario, args.policy, args.seed, args.out, args)
            o = m["summary"]["overall"]
            print(
                f"{scenario.name}/{m['policy']}: {o['requests']} requests, TTFT p99 "
                f"{o['ttft_s']['p99']} s, SLO attainment {o['slo_attainment']}, "
                f"report in {Path(args.out) / 'report.md'}"
            )
            return 0
        policies = [p for p in (args.policies or "").split(",") if p]
        arms: list[tuple[str, Any, str | None]] = []
        if scenario.variants:
            for v in scenario.variants:
                data = apply_settings(base, dict(v.set))
                data.pop("variants", None)
                sc = scenario_from_dict(data, f"{args.scenario} [variant {v.name}]")
                for p in policies or [v.policy]:
                    label = v.name if len(policies) <= 1 else f"{v.name}+{p}"
                    arms.append((label, sc, p or v.policy))
        else:
            for p in policies or [scenario.dataplane.policy]:
                arms.append((p, scenario, p))
        runs = []
        for label, sc, policy in arms:
            _, m = _one(sc, policy, args.seed, str(Path(args.out) / label), args)
            runs.append((label, m))
        write_comparison(runs, scenario, args.out)
        for label, m in runs:
            o = m["summary"]["overall"]
            print(
                f"{label:>24}: TTFT p50 {o['ttft_s']['p50']} p99 {o['ttft_s']['p99']} s, "
                f"prefix hit {o['prefix_hit_rate']}, churn {m['control']['churn_mean_second_half']}"
            )
        print(f"comparison in {Path(args.out) / 'report.md'}")
        return 0
    except (WorkloadError, PolicyConfigError, ValueError) as exc:
        print(f"fastroute sim: {exc}", file=sys.stderr)
        return 2
