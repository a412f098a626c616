"""The controller's prefix-reuse capacity gain in the simulator: each family with the LP on, the
gain capped at each ``--caps`` value (1 = off), plus the overload scenario with prefix caching
off (must not move) and on.

    python bench/reuse_gain.py                                # docs/controller.md's table
    python bench/reuse_gain.py --families bursts --caps 1 2 4 8   # the cap's sensitivity
    python bench/reuse_gain.py --decode-cost 1                    # β's sensitivity
    python bench/reuse_gain.py --check-model   # the formula against the emulator's step model

Every row is the mean over ``--seeds`` simulator runs of
``examples/scenarios/families/<family>.toml`` at ``--load`` with ``control.optimiser = "lp"``
and ``control.params.max_reuse_gain`` = the cap: goodput (req/s meeting both SLOs), requests
not served (shed or failed), TTFT p99 and the median gain the optimiser planned with (its
``info["reuse_gain"]`` of the first engine group). Runs in ``--jobs`` processes.

``--check-model`` instead compares the formula with the emulator's step-time model: one
engine's saturation capacity (:func:`fastroute.emulator.saturation.saturation_capacity_rps`)
on 384 of the workload's request shapes with every prompt cut by the hit fraction, over the
same uncut, against ``(P + β·N) / ((1 − h)·P + β·N)`` for β = 1 and 4.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from policy_matrix import FAMILIES, FAMILY_DIR  # noqa: E402

from controller.reuse import DECODE_TOKEN_COST  # noqa: E402

OVERLOAD = REPO / "examples" / "scenarios" / "overload.toml"


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """One simulator run; its goodput, unserved count, TTFT p99 and median gain."""
    from fastroute.sim import Simulator, summarize
    from fastroute.sim.scenario import load_scenario

    settings = {
        "control.optimiser": "lp",
        "control.params": {"max_reuse_gain": case["cap"], "reuse_decode_cost": case["beta"]},
        **case["settings"],
    }
    sc = load_scenario(case["path"], settings)
    res = Simulator(sc, policy=case["policy"], seed=case["seed"]).run()
    overall = summarize(res.records, slo=sc.slo, duration_s=sc.duration_s - sc.warmup_s)["overall"]
    ttft = sorted(r.ttft_s for r in res.records if r.ttft_s is not None)
    gains = [c.info["reuse_gain"][0] for c in res.control if "reuse_gain" in c.info]
    return {
        **{k: case[k] for k in ("name", "cap", "seed")},
        "goodput_rps": overall["goodput_rps"],
        "unserved": sum(1 for r in res.records if r.outcome != "ok"),
        "requests": len(res.records),
        "ttft_p99_s": ttft[int(0.99 * len(ttft))] if ttft else None,
        "median_gain": statistics.median(gains) if gains else 1.0,
    }


def cases(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (scenario, cap, seed) to run."""
    scenarios = [
        (f, str(FAMILY_DIR / f"{f}.toml"), args.policy, {"target_load": args.load})
        for f in args.families
    ]
    if args.overload:
        shed = {"dataplane.shedding": True}
        scenarios.append(("overload, caching off", str(OVERLOAD), "weighted-hrw", shed))
        cached = str(Path(args.overload_cached))
        scenarios.append(("overload, caching on", cached, args.policy, shed))
    out = []
    for name, path, policy, settings in scenarios:
        seeds = args.seeds if "overload" not in name else max(1, args.seeds // 2)
        for cap in args.caps:
            for seed in range(1, seeds + 1):
                out.append(
                    {"name": name, "path": path, "policy": policy, "settings": settings,
                     "cap": cap, "beta": args.decode_cost, "seed": seed}
                )  # fmt: skip
    return out


def cached_overload(directory: Path) -> Path:
    """The overload scenario with the engines' prefix caching turned on."""
    text = OVERLOAD.read_text().replace(
        "enable_prefix_caching = false", "enable_prefix_caching = true"
    )
    path = directory / "overload-cached.toml"
    path.write_text(text)
    return path


def table(results: list[dict[str, Any]], caps: list[float]) -> list[str]:
    """One markdown row per scenario and cap, the seeds averaged."""
    lines = [
        "| scenario | cap | goodput req/s | unserved / requests | TTFT p99 s | median gain |",
        "|---|---|---|---|---|---|",
    ]
    names = list(dict.fromkeys(r["name"] for r in results))
    for name in names:
        for cap in caps:
            rows = [r for r in results if r["name"] == name and r["cap"] == cap]
            p99 = [r["ttft_p99_s"] for r in rows if r["ttft_p99_s"] is not None]
            lines.append(
                f"| {name} | {cap:g} | {statistics.mean(r['goodput_rps'] for r in rows):.3f} "
                f"| {sum(r['unserved'] for r in rows)} / {sum(r['requests'] for r in rows)} "
                f"| {statistics.mean(p99):.2f} "
                f"| {statistics.mean(r['median_gain'] for r in rows):.2f} |"
            )
    return lines


#: Workloads of --check-model: the families' A40 (step-budget bound) and the overload
#: scenario's H100 at 64 sequences with caching on (sequence bound).
CHECK_SCENARIOS = ("bursts", "chat", "long-tail", "agentic", "overload, caching on")
CHECK_HIT_RATES = (0.3, 0.5, 0.7, 0.9)


def check_model(path: str) -> list[str]:
    """Markdown rows: the emulator's gain and the formula's (β = 1, 4) per hit rate."""
    from fastroute.emulator.saturation import saturation_capacity_rps
    from fastroute.sim import Simulator
    from fastroute.sim.scenario import load_scenario
    from fastroute.workload.shapes import request_shapes

    sim = Simulator(load_scenario(path), seed=1)
    shapes = request_shapes(sim.sessions, 384, seed=1)
    engine = sim.engines[0]
    prompt = statistics.mean(p for p, _ in shapes)
    output = statistics.mean(o for _, o in shapes)
    base = saturation_capacity_rps(engine.profile, engine.config, shapes)
    emulator = []
    for h in CHECK_HIT_RATES:
        cut = [(max(1, round(p * (1 - h))), o) for p, o in shapes]
        emulator.append(saturation_capacity_rps(engine.profile, engine.config, cut) / base)
    head = f"{engine.profile.name}, {Path(path).stem} ({prompt:.0f} / {output:.0f})"
    rows = [f"| {head} | emulator | " + " | ".join(f"{g:.2f}" for g in emulator) + " |"]
    for beta in (1.0, 4.0):
        model = [
            (prompt + beta * output) / ((1 - h) * prompt + beta * output) for h in CHECK_HIT_RATES
        ]
        rows.append(f"| | β = {beta:g} | " + " | ".join(f"{g:.2f}" for g in model) + " |")
    return rows


def main() -> None:
    """Run the cases and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--caps", nargs="+", type=float, default=[1.0, 4.0])
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--load", type=float, default=0.9)
    ap.add_argument("--policy", default="prefix-hrw")
    ap.add_argument("--decode-cost", type=float, default=DECODE_TOKEN_COST, help="β")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--no-overload", dest="overload", action="store_false")
    ap.add_argument("--work-dir", type=Path, default=Path("out/reuse-gain"))
    ap.add_argument("--check-model", action="store_true")
    args = ap.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    args.overload_cached = cached_overload(args.work_dir)
    if args.check_model:
        paths = [
            str(args.overload_cached) if "overload" in name else str(FAMILY_DIR / f"{name}.toml")
            for name in CHECK_SCENARIOS
        ]
        print("| engine, workload (prompt / output tokens) | | " + " | ".join(
            f"h = {h}" for h in CHECK_HIT_RATES) + " |")  # fmt: skip
        print("|---|---|" + "---|" * len(CHECK_HIT_RATES))
        for path in paths:
            print("\n".join(check_model(path)))
        return
    todo = cases(args)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(run_case, todo))
    print("\n".join(table(results, args.caps)))


if __name__ == "__main__":
    main()
