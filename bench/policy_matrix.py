"""Policy matrix: workload families x load x seeds x routing policies x (workers, proxies).

    python bench/policy_matrix.py --quick                 # < 2 min: one seed, load 0.9, short runs
    python bench/policy_matrix.py                         # the full matrix
    python bench/policy_matrix.py --policies my-policy    # add a policy to the default four
    python bench/policy_matrix.py --families rag,chat --routers cache-aware --out out/m
    python bench/policy_matrix.py --configs 4x2 --set dataplane.peer_poll_interval_s=1
    python bench/policy_matrix.py --families examples/scenarios/azure-conv.toml --loads 0.9,1.2

Every cell is one simulator run of ``examples/scenarios/families/<family>.toml`` (or of the
scenario file a ``--families`` entry ending in ``.toml`` names) with its
``target_load``, ``dataplane.workers`` and ``dataplane.proxies`` set, the policy and the
seed. Per family it prints and writes (``<out>/<family>.md``) a markdown table, one row
per (policy, workers x proxies, load) averaged over the seeds: goodput (requests/s meeting
both SLOs), TTFT p50/p99, TBOT p99, the engines' prefix-cache hit rate (cached / queried
prompt tokens, engine side) and the max/min ratio of requests served per engine; every
run's figures go to ``<out>/results.json``. With several routers it also writes
``<out>/versus.md``: the first router against the best of the others, cell by cell
(:func:`versus_table`). Runs are sequential unless ``--jobs`` > 1.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
FAMILY_DIR = REPO / "examples" / "scenarios" / "families"
#: Families of the matrix, in table order (scenario files under FAMILY_DIR).
FAMILIES = (
    "chat",
    "prefix-tree",
    "mooncake",
    "rag",
    "agentic",
    "long-tail",
    "hot-prompt",
    "bursts",
)
DEFAULT_POLICIES = ("weighted-hrw", "cache-aware", "least-request", "round-robin")
LOADS = (0.7, 0.9)
SEEDS = 2
#: (workers per proxy, proxies per region).
CONFIGS = ((1, 1), (4, 2))
#: --quick: one seed, one load, short windows (the scenario's fleet and family unchanged).
QUICK_LOADS = (0.9,)
QUICK_SEEDS = 1
QUICK_SETTINGS = {"duration_s": 20.0, "warmup_s": 5.0, "drain_s": 20.0}


def run_cell(cell: dict[str, Any]) -> dict[str, Any]:
    """One simulator run; returns its figures (JSON-serialisable)."""
    from fastroute.sim import Simulator, summarize
    from fastroute.sim.scenario import load_scenario

    settings = {
        "target_load": cell["load"],
        "dataplane.workers": cell["workers"],
        "dataplane.proxies": cell["proxies"],
        **cell["settings"],
    }
    scenario = load_scenario(cell["path"], settings)
    wall0 = time.perf_counter()
    sim = Simulator(scenario, policy=cell["policy"], seed=cell["seed"])
    result = sim.run()
    window_s = scenario.duration_s - scenario.warmup_s
    overall = summarize(result.records, slo=scenario.slo, duration_s=window_s)["overall"]
    hits = queried = 0
    for e in sim.engines:
        h, q = e.cache_hit_tokens
        hits += h
        queried += q
    served = Counter(r.engine for r in result.records if r.outcome == "ok")
    per_engine = [served.get(name, 0) for name in result.engine_names]
    low, high = min(per_engine), max(per_engine)
    return {
        **{k: cell[k] for k in ("family", "load", "seed", "workers", "proxies")},
        "policy": cell.get("label", cell["policy"]),
        "requests": overall["requests"],
        "goodput_rps": overall["goodput_rps"],
        "ttft_p50_s": overall["ttft_s"]["p50"],
        "ttft_p99_s": overall["ttft_s"]["p99"],
        "tbot_p99_s": overall["tbot_s"]["p99"],
        "engine_prefix_hit_rate": hits / queried if queried else None,
        "served_per_engine": per_engine,
        "load_ratio_max_min": high / low if low else (math.inf if high else None),
        "wall_s": time.perf_counter() - wall0,
    }


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "–"
    if math.isinf(value):
        return "∞"
    return f"{value:.{digits}f}"


def family_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown table of one family's runs, seeds averaged."""
    groups: dict[tuple[str, int, int, float], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["policy"], r["workers"], r["proxies"], r["load"]), []).append(r)
    lines = [
        "| policy | workers×proxies | load | goodput req/s | TTFT p50 s | TTFT p99 s "
        "| TBOT p99 s | engine prefix hit | max/min engine load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (policy, workers, proxies, load), rs in groups.items():
        ratio = [r["load_ratio_max_min"] for r in rs]
        lines.append(
            f"| {policy} | {workers}×{proxies} | {load:g} "
            f"| {_fmt(_mean([r['goodput_rps'] for r in rs]))} "
            f"| {_fmt(_mean([r['ttft_p50_s'] for r in rs]), 3)} "
            f"| {_fmt(_mean([r['ttft_p99_s'] for r in rs]), 3)} "
            f"| {_fmt(_mean([r['tbot_p99_s'] for r in rs]), 3)} "
            f"| {_fmt(_mean([r['engine_prefix_hit_rate'] for r in rs]))} "
            f"| {_fmt(math.inf if math.inf in ratio else _mean(ratio))} |"
        )
    return "\n".join(lines)


def versus_table(results: Sequence[dict[str, Any]], subject: str) -> str:
    """Markdown table: per workers×proxies, policy ``subject`` against the best of the other
    policies in each cell (family × load, seeds averaged).

    Goodput is ``subject``'s over the best other's (geometric mean over the cells and the worst
    cell), the cells where it is best (and within 1 % of the best), TTFT p99 is ``subject``'s
    over the lowest other's. Cells without ``subject`` or without another policy are left out;
    a cell where no policy served anything counts as a tie."""
    means: dict[tuple[int, int], dict[tuple[str, float], dict[str, tuple[float, float]]]] = {}
    groups: dict[tuple[int, int, str, float, str], list[dict[str, Any]]] = {}
    for r in results:
        key = (r["workers"], r["proxies"], r["family"], r["load"], r["policy"])
        groups.setdefault(key, []).append(r)
    for (workers, proxies, family, load, policy), rs in groups.items():
        goodput = _mean([r["goodput_rps"] for r in rs]) or 0.0
        p99 = _mean([r["ttft_p99_s"] for r in rs])
        cells = means.setdefault((workers, proxies), {})
        cells.setdefault((family, load), {})[policy] = (goodput, math.nan if p99 is None else p99)
    lines = [
        "| workers×proxies | cells | goodput / best other's, geometric mean "
        "| worst cell | cells best (within 1 %) | TTFT p99 / best other's, geometric mean "
        "| worst cell |",
        "|---|---|---|---|---|---|---|",
    ]
    for (workers, proxies), cells in sorted(means.items()):
        gains: list[tuple[float, str]] = []
        tails: list[tuple[float, str]] = []
        for (family, load), by_policy in cells.items():
            others = [v for p, v in by_policy.items() if p != subject]
            if subject not in by_policy or not others:
                continue
            own_goodput, own_p99 = by_policy[subject]
            best_goodput = max(g for g, _ in others)
            ratio = own_goodput / best_goodput if best_goodput > 0 else 1.0
            gains.append((ratio, f"{family} {load:g}"))
            lowest_p99 = min((t for _, t in others if not math.isnan(t)), default=math.nan)
            if lowest_p99 > 0 and not math.isnan(own_p99):
                tails.append((own_p99 / lowest_p99, f"{family} {load:g}"))
        if not gains:
            continue
        worst = min(gains)
        lines.append(
            f"| {workers}×{proxies} | {len(gains)} | {_geomean([g for g, _ in gains]):.3f} "
            f"| {worst[0]:.3f} ({worst[1]}) | {sum(g >= 1.0 for g, _ in gains)} "
            f"({sum(g >= 0.99 for g, _ in gains)}) | "
            + (
                f"{_geomean([t for t, _ in tails]):.2f} | {max(tails)[0]:.2f} ({max(tails)[1]}) |"
                if tails
                else "– | – |"
            )
        )
    return "\n".join(lines)


def _geomean(values: Sequence[float]) -> float:
    """The geometric mean; 0 when a value is 0 (a router that served nothing in a cell)."""
    if not values:
        return math.nan
    if min(values) <= 0.0:
        return 0.0
    return math.exp(sum(math.log(v) for v in values) / len(values))


def build_cells(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The matrix's runs, in table order."""
    settings = dict(QUICK_SETTINGS) if args.quick else {}
    seeds = range(1, 1 + (QUICK_SEEDS if args.quick else args.seeds))
    loads = QUICK_LOADS if args.quick and args.loads is None else (args.loads or LOADS)
    cells = []
    for entry in args.families:
        family, path = scenario_of(entry)
        for policy in args.routers:
            for workers, proxies in args.configs:
                for load in loads:
                    for seed in seeds:
                        cells.append(
                            {
                                "family": family,
                                "path": str(path),
                                "policy": policy,
                                "load": load,
                                "seed": seed,
                                "workers": workers,
                                "proxies": proxies,
                                "settings": {
                                    **settings,
                                    **args.set,
                                    **(
                                        {"dataplane.policy_params": args.params}
                                        if args.params
                                        else {}
                                    ),
                                },
                                "label": policy
                                + (json.dumps(args.params, sort_keys=True) if args.params else "")
                                + "".join(f" {k}={v}" for k, v in args.set.items()),
                            }
                        )
    return cells


def scenario_of(entry: str) -> tuple[str, Path]:
    """``(name, scenario file)`` of a ``--families`` entry: a family name (its file under
    ``FAMILY_DIR``) or the path of any scenario file ending in ``.toml`` (named by its stem),
    e.g. a trace replay such as ``examples/scenarios/azure-conv.toml``."""
    if entry.endswith(".toml"):
        return Path(entry).stem, Path(entry)
    return entry, FAMILY_DIR / f"{entry}.toml"


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _config(text: str) -> tuple[int, int]:
    workers, _, proxies = text.partition("x")
    return int(workers), int(proxies)


def _setting(text: str) -> tuple[str, Any]:
    from fastroute.sim.scenario import ScenarioError, parse_setting

    try:
        return parse_setting(text)
    except ScenarioError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from fastroute.policy.registry import POLICIES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--families",
        type=_csv,
        default=list(FAMILIES),
        help="comma list of family names or scenario .toml paths",
    )
    ap.add_argument(
        "--routers",
        type=_csv,
        default=list(DEFAULT_POLICIES),
        help=f"policies to run instead of the default {','.join(DEFAULT_POLICIES)}",
    )
    ap.add_argument(
        "--policies", type=_csv, default=[], help="policies added to --routers (comma list)"
    )
    ap.add_argument("--loads", type=lambda s: [float(x) for x in _csv(s)], default=None)
    ap.add_argument("--seeds", type=int, default=SEEDS, help="seeds per cell (1, 2, ...)")
    ap.add_argument("--quick", action="store_true", help="one seed, load 0.9, 20 s windows")
    ap.add_argument("--jobs", type=int, default=1, help="parallel runs (processes)")
    ap.add_argument(
        "--params",
        type=json.loads,
        default={},
        help="tunables for every policy run, JSON (e.g. '{\"balance_factor\": 3.0}'); "
        "the results label the policy with them",
    )
    ap.add_argument(
        "--configs",
        type=lambda s: [_config(x) for x in _csv(s)],
        default=list(CONFIGS),
        help="WORKERSxPROXIES comma list; default 1x1,4x2",
    )
    ap.add_argument(
        "--set",
        type=_setting,
        action="append",
        default=[],
        help="scenario setting KEY=VALUE for every run (repeatable), e.g. "
        "dataplane.peer_poll_interval_s=1; the results label the policy with it",
    )
    ap.add_argument("--out", type=Path, default=REPO / "out" / "policy-matrix")
    args = ap.parse_args(argv)
    args.set = dict(args.set)
    args.routers = list(dict.fromkeys([*args.routers, *args.policies]))
    unknown = [p for p in args.routers if p not in POLICIES]
    if unknown:
        ap.error(f"unknown policies {unknown}; registered: {sorted(POLICIES)}")
    missing = [f for f in args.families if not scenario_of(f)[1].is_file()]
    if missing:
        ap.error(f"no scenario for families {missing} (names in {FAMILY_DIR}, or .toml paths)")
    if args.seeds < 1 or args.jobs < 1:
        ap.error("--seeds and --jobs must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the matrix, print and write the tables and the results JSON."""
    args = parse_args(argv)
    cells = build_cells(args)
    wall0 = time.perf_counter()
    print(f"policy matrix: {len(cells)} runs", file=sys.stderr)
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(run_cell, cells))
    else:
        results = []
        for i, cell in enumerate(cells, 1):
            results.append(run_cell(cell))
            r = results[-1]
            print(
                f"[{i}/{len(cells)}] {r['family']} {r['policy']} {r['workers']}x{r['proxies']} "
                f"load {r['load']:g} seed {r['seed']}: {r['wall_s']:.1f} s",
                file=sys.stderr,
            )
    wall = time.perf_counter() - wall0
    args.out.mkdir(parents=True, exist_ok=True)
    for family in (scenario_of(entry)[0] for entry in args.families):
        table = family_table([r for r in results if r["family"] == family])
        text = f"## {family}\n\n{table}\n"
        (args.out / f"{family}.md").write_text(text)
        print(text)
    if len(args.routers) > 1:
        text = f"## {cells[0]['label']} against the others\n\n" + versus_table(
            results, cells[0]["label"]
        )
        (args.out / "versus.md").write_text(text + "\n")
        print(text + "\n")
    summary = {"quick": args.quick, "runs": len(results), "wall_s": wall, "results": results}
    (args.out / "results.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"{len(results)} runs in {wall:.0f} s; results in {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
