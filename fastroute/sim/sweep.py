"""``fastroute sim sweep``: a grid of cases × arms × seeds over one base scenario.

An experiment file (TOML) names a base scenario and the grid::

    scenario = "pd-base.toml"          # relative to this file
    seeds = [1, 2, 3]
    [[cases]]                           # what the workload/fleet is (rows of the table)
    name = "2P+4D/chat-burst"
    set = { "replay.burst_factor" = 2.0 }
    [[arms]]                            # what is compared (columns)
    name = "round-robin"
    policy = "round-robin"
    set = {}

Every (case, arm, seed) is one :class:`~fastroute.sim.core.Simulator` run of the base
scenario with the case's then the arm's dotted settings applied. The sweep writes
``runs.json`` (one row per run: goodput share, p99 TTFT/TBOT, shed rate, ...),
``report.md`` (per case: mean over seeds and every seed) and ``goodput.png`` (if
matplotlib is installed).
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from fastroute.sim.scenario import (
    ScenarioError,
    apply_settings,
    load_scenario_dict,
    scenario_from_dict,
)

__all__ = ["Sweep", "SweepArm", "SweepCase", "load_sweep", "run_sweep", "summarize_runs"]

_OPTS: dict[str, Any] = {"frozen": True, "kw_only": True, "forbid_unknown_fields": True}


class SweepArm(msgspec.Struct, **_OPTS):
    """One compared arm: a label, a policy and the settings it changes."""

    name: str
    policy: str | None = None
    set: dict[str, Any] = {}


class SweepCase(msgspec.Struct, **_OPTS):
    """One case (workload × fleet): a label and the settings it changes."""

    name: str
    set: dict[str, Any] = {}
    arms: tuple[str, ...] = ()  # restrict to these arms (empty: all)


class Sweep(msgspec.Struct, **_OPTS):
    """An experiment file (see the module docstring)."""

    scenario: str
    seeds: tuple[int, ...] = (1,)
    cases: tuple[SweepCase, ...] = ()
    arms: tuple[SweepArm, ...] = ()
    base_dir: str = ""


def load_sweep(path: str | Path) -> Sweep:
    """Read and check an experiment file.

    Raises
    ------
    ScenarioError
        Missing file, invalid TOML, unknown keys, empty grid or duplicate names.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ScenarioError(f"experiment file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{path}: invalid TOML: {exc}") from None
    data.setdefault("base_dir", str(path.resolve().parent))
    try:
        sweep = msgspec.convert(data, Sweep)
    except msgspec.ValidationError as exc:
        raise ScenarioError(f"{path}: {exc}") from None
    arms = [a.name for a in sweep.arms]
    cases = [c.name for c in sweep.cases]
    if not arms or not cases or not sweep.seeds:
        raise ScenarioError(f"{path}: need at least one arm, one case and one seed")
    if len(set(arms)) != len(arms) or len(set(cases)) != len(cases):
        raise ScenarioError(f"{path}: arm and case names must be unique")
    for c in sweep.cases:
        unknown = sorted(set(c.arms) - set(arms))
        if unknown:
            raise ScenarioError(f"{path}: case {c.name!r} names unknown arms {unknown}")
    return sweep


def _row(case: str, arm: str, seed: int, metrics: dict[str, Any]) -> dict[str, Any]:
    o = metrics["summary"]["overall"]
    return {
        "case": case,
        "arm": arm,
        "seed": seed,
        "requests": o["requests"],
        "goodput_share": o["slo_attainment"],
        "goodput_rps": o["goodput_rps"],
        "ttft_p99_s": o["ttft_s"]["p99"],
        "tbot_p99_s": o["tbot_s"]["p99"],
        "ttft_p50_s": o["ttft_s"]["p50"],
        "shed_rate": o["shed_rate"],
        "failure_rate": o["failure_rate"],
        "wall_s": metrics["sim"]["wall_s"],
    }


def run_sweep(
    path: str | Path,
    out_dir: str | Path,
    *,
    seeds: tuple[int, ...] | None = None,
    settings: dict[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every (case, arm, seed) of the experiment file; write the outputs.

    Parameters
    ----------
    path : str or Path
        Experiment file.
    out_dir : str or Path
        Where ``runs.json``, ``report.md`` and ``goodput.png`` go.
    seeds : tuple of int, optional
        Override the file's seeds.
    settings : dict, optional
        Dotted settings applied to the base scenario first (e.g. a shorter duration).
    progress : callable, optional
        Called with a one-line description after each run.

    Returns
    -------
    list of dict
        One row per run (see :func:`_row`).
    """
    from fastroute.sim.core import Simulator
    from fastroute.sim.report import result_metrics

    sweep = load_sweep(path)
    base_path = Path(sweep.scenario)
    if not base_path.is_absolute():
        base_path = Path(sweep.base_dir) / base_path
    base = apply_settings(load_scenario_dict(base_path), settings or {})
    arms = {a.name: a for a in sweep.arms}
    rows = []
    for case in sweep.cases:
        case_data = apply_settings(base, case.set)
        for arm_name in case.arms or tuple(arms):
            arm = arms[arm_name]
            data = apply_settings(case_data, arm.set)
            data.pop("variants", None)
            sc = scenario_from_dict(data, f"{base_path} [{case.name} / {arm.name}]")
            for seed in seeds or sweep.seeds:
                sim = Simulator(sc, policy=arm.policy, seed=seed)
                result = sim.run()
                m = result_metrics(result, sim.scenario, policy=sim.policy_name, seed=seed)
                row = _row(case.name, arm.name, seed, m)
                rows.append(row)
                if progress is not None:
                    progress(
                        f"{case.name} / {arm.name} / seed {seed}: goodput "
                        f"{row['goodput_share']:.3f}, TTFT p99 {row['ttft_p99_s']:.3f} s "
                        f"({row['wall_s']:.1f} s)"
                    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "runs.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "report.md").write_text(summarize_runs(rows, [a.name for a in sweep.arms]))
    _plot(rows, [c.name for c in sweep.cases], [a.name for a in sweep.arms], out)
    return rows


def _mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _f(v: float | None, scale: float = 1.0, digits: int = 3) -> str:
    return "–" if v is None else f"{v * scale:.{digits}f}"


def summarize_runs(rows: list[dict[str, Any]], arm_order: list[str]) -> str:
    """Markdown: per case, one line per arm (mean over seeds), then goodput per seed."""
    lines = ["# Sweep results", ""]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    for case in cases:
        in_case = [r for r in rows if r["case"] == case]
        arms = [a for a in arm_order if any(r["arm"] == a for r in in_case)]
        seeds = sorted({r["seed"] for r in in_case})
        lines += [
            f"## {case}",
            "",
            "| arm | goodput (share) | "
            + " | ".join(f"seed {s}" for s in seeds)
            + " | TTFT p99 (s) | TBOT p99 (ms) | shed |",
            "|---|---|" + "---|" * len(seeds) + "---|---|---|",
        ]
        for a in arms:
            rs = [r for r in in_case if r["arm"] == a]
            by_seed = {r["seed"]: r for r in rs}
            lines.append(
                f"| {a} | {_f(_mean([r['goodput_share'] for r in rs]))} | "
                + " | ".join(
                    _f(by_seed[s]["goodput_share"]) if s in by_seed else "–" for s in seeds
                )
                + f" | {_f(_mean([r['ttft_p99_s'] for r in rs]))}"
                f" | {_f(_mean([r['tbot_p99_s'] for r in rs]), 1000, 1)}"
                f" | {_f(_mean([r['shed_rate'] for r in rs]))} |"
            )
        lines.append("")
    lines.append(
        "goodput (share) = requests meeting both SLOs / all requests (SLO attainment, "
        "docs/metrics.md); p99s are means over seeds of each run's p99."
    )
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict[str, Any]], cases: list[str], arms: list[str], out: Path) -> None:
    from fastroute.sim.report import matplotlib_or_none

    plt = matplotlib_or_none()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(cases)), 4.8))
    width = 0.8 / max(1, len(arms))
    for j, a in enumerate(arms):
        xs, ys, lo, hi = [], [], [], []
        for i, c in enumerate(cases):
            vals = [r["goodput_share"] for r in rows if r["case"] == c and r["arm"] == a]
            vals = [v for v in vals if v is not None]
            if not vals:
                continue
            m = sum(vals) / len(vals)
            xs.append(i + (j - (len(arms) - 1) / 2) * width)
            ys.append(m)
            lo.append(m - min(vals))
            hi.append(max(vals) - m)
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=a)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(cases, rotation=15, ha="right", fontsize=8)
    ax.set_ylabel("goodput (share meeting SLOs)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, ncol=min(3, len(arms)), loc="lower center", bbox_to_anchor=(0.5, 1.0))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "goodput.png", dpi=110)
    plt.close(fig)
