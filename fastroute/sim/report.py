"""Run outputs: ``metrics.json``, ``report.md`` and PNG plots (matplotlib is optional).

``metrics.json`` holds only simulated quantities under ``summary``, ``fleet`` and
``control``, so two runs with the same seed produce the same bytes there; wall-clock
figures (events per second, optimiser time) are kept apart under ``sim``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fastroute.sim.core import SimResult
from fastroute.sim.metrics import summarize, weight_amplitude
from fastroute.sim.scenario import Scenario

__all__ = ["result_metrics", "write_run", "write_comparison", "matplotlib_or_none"]


def _clean(value: Any) -> Any:
    """JSON-safe: numpy scalars to Python, NaN/inf to None."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if isinstance(value, np.ndarray):
        return _clean(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def result_metrics(
    result: SimResult, scenario: Scenario, *, policy: str, seed: int
) -> dict[str, Any]:
    """All metrics of one run (docs/metrics.md), JSON-ready."""
    duration = scenario.duration_s - scenario.warmup_s
    summary = summarize(result.records, slo=scenario.slo, duration_s=duration)
    # Control metrics over the measured window only: the warm-up and the drain (demand
    # falling to zero) are not steady state.
    control = [c for c in result.control if scenario.warmup_s <= c.t_s <= scenario.duration_s]
    half = control[len(control) // 2 :]
    churn = [c.churn for c in control]
    series = np.array([c.weights for c in half]) if half else np.zeros((0, 0, 0))
    # The same request metrics restricted to each fault's window (arrivals inside it).
    faults = []
    for f in scenario.faults:
        end = min(f.start_s + f.duration_s, scenario.duration_s)
        inside = [r for r in result.records if f.start_s <= r.arrival_s < end]
        if inside:
            faults.append(
                {
                    "kind": f.kind,
                    "start_s": f.start_s,
                    "end_s": end,
                    "summary": summarize(
                        inside, slo=scenario.slo, duration_s=end - f.start_s, group_by=()
                    )["overall"],
                }
            )
    engines = result.engines
    fleet = {
        "engines": engines,
        "preemptions": sum(e["preemptions"] for e in engines),
        "utilisation_mean": float(np.mean([e["utilisation"] for e in engines])),
        "utilisation_max": float(np.max([e["utilisation"] for e in engines])),
    }
    return _clean(
        {
            "scenario": scenario.name,
            "policy": policy,
            "seed": seed,
            "optimiser": scenario.control.optimiser,
            "summary": summary,
            "faults": faults,
            "fleet": fleet,
            "control": {
                "periods": len(control),
                "churn_mean": float(np.mean(churn)) if churn else None,
                "churn_mean_second_half": (
                    float(np.mean([c.churn for c in half])) if half else None
                ),
                "weight_amplitude_second_half": weight_amplitude(series) if half else None,
                "shed_fraction_max": (
                    float(max(c.shed_fraction.max(initial=0.0) for c in control))
                    if control
                    else None
                ),
            },
            "sim": {
                "events": result.events,
                "heap_events": result.heap_events,
                "engine_steps": result.steps,
                "wall_s": result.wall_s,
                "events_per_s": result.events / result.wall_s if result.wall_s else None,
                "horizon_s": result.horizon_s,
                "x_real_time": result.horizon_s / result.wall_s if result.wall_s else None,
                "optimiser_wall_s_mean": (
                    float(np.mean([c.optimiser_wall_s for c in control])) if control else None
                ),
            },
        }
    )


def _fmt(v: Any, scale: float = 1.0, digits: int = 3) -> str:
    if v is None:
        return "–"
    return f"{v * scale:.{digits}f}"


def _row(label: str, m: dict[str, Any]) -> str:
    return (
        f"| {label} | {m['requests']} | {_fmt(m['ttft_s']['p50'])} | {_fmt(m['ttft_s']['p99'])} "
        f"| {_fmt(m['tbot_s']['p50'], 1000, 1)} | {_fmt(m['tbot_s']['p99'], 1000, 1)} "
        f"| {_fmt(m['e2e_s']['p99'], 1, 2)} | {_fmt(m['slo_attainment'])} "
        f"| {_fmt(m['goodput_rps'], 1, 2)} | {_fmt(m['prefix_hit_rate'])} "
        f"| {_fmt(m['affinity_loss'])} | {_fmt(m['shed_rate'])} | {_fmt(m['failure_rate'])} "
        f"| {_fmt(m['load_amplification'])} |"
    )


_HEADER = (
    "| | requests | TTFT p50 (s) | TTFT p99 (s) | TBOT p50 (ms) | TBOT p99 (ms) | e2e p99 (s) "
    "| SLO att. | goodput (req/s) | prefix hit | affinity loss | shed | failed | attempts/req |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def matplotlib_or_none() -> Any:
    """``matplotlib.pyplot`` with the Agg backend, or None if matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _plots(result: SimResult, out: Path, plt: Any, title: str) -> list[str]:
    files = []
    control = result.control
    if control:
        t = [c.t_s for c in control]
        w = np.array([c.weights for c in control])
        rows = min(w.shape[1], 4)
        fig, axes = plt.subplots(rows, 1, figsize=(9, 2.6 * rows), squeeze=False, sharex=True)
        for g in range(rows):
            ax = axes[g][0]
            for e in range(w.shape[2]):
                if w[:, g, e].max() > 0:
                    ax.plot(t, w[:, g, e], lw=1, label=result.engine_names[e])
            ax.set_ylabel("weight")
            ax.set_title(f"{title}: class {result.class_labels[g]}", fontsize=9)
        axes[-1][0].set_xlabel("time (s)")
        if w.shape[2] <= 12:
            axes[0][0].legend(fontsize=6, ncol=4)
        fig.tight_layout()
        fig.savefig(out / "weights.png", dpi=110)
        plt.close(fig)
        files.append("weights.png")
        fig, ax = plt.subplots(figsize=(9, 2.6))
        ax.plot(t, [100 * c.churn for c in control], lw=1)
        ax.set_xlabel("time (s)")
        ax.set_ylabel("churn per period (%)")
        ax.set_title(f"{title}: weight churn", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / "churn.png", dpi=110)
        plt.close(fig)
        files.append("churn.png")
    ok = [r for r in result.records if r.outcome == "ok" and r.ttft_s is not None]
    if ok:
        arr = np.array([r.arrival_s for r in ok])
        ttft = np.array([r.ttft_s for r in ok])
        width = max(5.0, (arr.max() - arr.min()) / 60)
        edges = np.arange(arr.min(), arr.max() + width, width)
        idx = np.digitize(arr, edges)
        mids, p99, p50 = [], [], []
        for i in range(1, len(edges)):
            sel = ttft[idx == i]
            if sel.size:
                mids.append(edges[i - 1] + width / 2)
                p99.append(np.percentile(sel, 99))
                p50.append(np.percentile(sel, 50))
        fig, ax = plt.subplots(figsize=(9, 2.6))
        ax.plot(mids, p50, lw=1, label="p50")
        ax.plot(mids, p99, lw=1, label="p99")
        ax.set_yscale("log")
        ax.set_xlabel("arrival time (s)")
        ax.set_ylabel("TTFT (s)")
        ax.legend(fontsize=7)
        ax.set_title(f"{title}: TTFT over time", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / "ttft.png", dpi=110)
        plt.close(fig)
        files.append("ttft.png")
    return files


def write_run(
    result: SimResult, scenario: Scenario, out_dir: str | Path, *, policy: str, seed: int
) -> dict[str, Any]:
    """Write ``metrics.json``, ``report.md`` and plots of one run into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    metrics = result_metrics(result, scenario, policy=policy, seed=seed)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    plt = matplotlib_or_none()
    plots = _plots(result, out, plt, f"{scenario.name} / {policy}") if plt else []
    s = metrics["summary"]
    lines = [
        f"# {scenario.name}: policy `{policy}`, optimiser `{scenario.control.optimiser}`, "
        f"seed {seed}",
        "",
        scenario.description.strip(),
        "",
        "## Requests",
        "",
        _HEADER,
        _row("all", s["overall"]),
        *(_row(f"class {k}", v) for k, v in s["by_cls"].items()),
        *(_row(f"region {k}", v) for k, v in s["by_source"].items()),
        *(
            _row(f"during {f['kind']} [{f['start_s']:g}, {f['end_s']:g}) s", f["summary"])
            for f in metrics["faults"]
        ),
        "",
        f"SLO: TTFT ≤ {scenario.slo.ttft_s} s and mean TBOT ≤ {scenario.slo.tbot_s * 1000:g} ms. "
        "Definitions: docs/metrics.md.",
        "",
        "## Control plane",
        "",
        f"- periods: {metrics['control']['periods']}, mean churn "
        f"{_fmt(metrics['control']['churn_mean'], 100, 2)} % per period "
        f"(second half {_fmt(metrics['control']['churn_mean_second_half'], 100, 2)} %), "
        "weight amplitude (second half) "
        f"{_fmt(metrics['control']['weight_amplitude_second_half'])}",
        "",
        "## Fleet",
        "",
        "| engine | region | role | capacity (req/s) | utilisation | preemptions | prefix hit |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {e['name']} | {e['region']} | {e['role']} | {e['capacity_rps']:.2f} "
            f"| {e['utilisation']:.3f} | {e['preemptions']} | {_fmt(e['prefix_hit_rate'])} |"
            for e in metrics["fleet"]["engines"]
        ),
        "",
        "## Simulation",
        "",
        f"- {metrics['sim']['events']} events ({metrics['sim']['engine_steps']} engine steps, "
        f"{metrics['sim']['heap_events']} through the heap) in {metrics['sim']['wall_s']:.2f} s "
        f"wall: {_fmt(metrics['sim']['events_per_s'], 1, 0)} events/s, "
        f"{_fmt(metrics['sim']['x_real_time'], 1, 1)}× real time",
        "",
    ]
    if plots:
        lines += ["## Plots", "", *(f"![{p}]({p})" for p in plots), ""]
    else:
        lines += ["(plots skipped: matplotlib is not installed; `pip install matplotlib`)", ""]
    (out / "report.md").write_text("\n".join(lines))
    return metrics


def write_comparison(
    runs: Sequence[tuple[str, dict[str, Any]]], scenario: Scenario, out_dir: str | Path
) -> None:
    """Write the side-by-side ``report.md`` / ``metrics.json`` of ``fastroute sim compare``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(
        json.dumps({label: m for label, m in runs}, indent=2, sort_keys=True) + "\n"
    )
    lines = [
        f"# {scenario.name}: comparison",
        "",
        scenario.description.strip(),
        "",
        _HEADER,
        *(_row(label, m["summary"]["overall"]) for label, m in runs),
        *(
            _row(f"{label}, during {f['kind']} [{f['start_s']:g}, {f['end_s']:g}) s", f["summary"])
            for label, m in runs
            for f in m["faults"]
        ),
        "",
        "| | churn/period (%) | weight amplitude | preemptions | utilisation max |",
        "|---|---|---|---|---|",
        *(
            f"| {label} | {_fmt(m['control']['churn_mean_second_half'], 100, 2)} "
            f"| {_fmt(m['control']['weight_amplitude_second_half'])} "
            f"| {m['fleet']['preemptions']} | {_fmt(m['fleet']['utilisation_max'])} |"
            for label, m in runs
        ),
        "",
        "Per-run reports: " + ", ".join(f"[{label}]({label}/report.md)" for label, _ in runs),
        "",
    ]
    plt = matplotlib_or_none()
    if plt is not None and runs:
        labels = [label for label, _ in runs]
        fig, axes = plt.subplots(3, 1, figsize=(max(7.0, 0.5 * len(labels)), 9.0))
        for ax, (key, sub, name) in zip(
            axes,
            [
                ("ttft_s", "p99", "TTFT p99 (s)"),
                ("ttft_s", "p50", "TTFT p50 (s)"),
                ("prefix_hit_rate", None, "prefix hit rate"),
            ],
            strict=True,
        ):
            vals = []
            for _, m in runs:
                v = m["summary"]["overall"][key]
                v = v[sub] if sub else v
                vals.append(v or 0.0)
            ax.bar(range(len(labels)), vals)
            ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=7)
            ax.set_title(name, fontsize=9)
        fig.tight_layout()
        fig.savefig(out / "compare.png", dpi=110)
        plt.close(fig)
        lines += ["![compare](compare.png)", ""]
    (out / "report.md").write_text("\n".join(lines))
