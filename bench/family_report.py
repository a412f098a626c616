"""Tables, acceptance check and plot of a fleet-benchmark run over the workload families.

    fastroute bench fleet examples/bench/families/*.toml --out bench-results/families
    python bench/family_report.py bench-results/families [RERUN_DIR ...] --plot out.png

Reads ``<dir>/<spec>/results.json`` of every spec the run finished (``<family>-<load>``,
as ``examples/bench/families/``; a later directory's routers replace the same routers'
rows of the same seed, for a re-run; another seed, from ``fastroute bench fleet --seed``, is
another sample, and a router run on several seeds also gets their mean as seed "mean")
and prints markdown: per family, one row per router and load
(goodput = share of the requests sent that met both SLOs, TTFT p50/p99, TBOT p99, engine
prefix-hit rate, max/min engine share, the largest served / LP share, router CPU per
request); then, per family and load, the default against the issue's acceptance figures:
the best router, the best peer (sglang-router / vllm-router), the best round robin, the p99
ratio to the best peer, the prefix-hit rate at 1 × 1 and 4 × 2 (``default-4x2``, with
``cache-aware`` beside it), and router CPU against ``weighted-hrw``. ``--plot`` draws each
family's goodput and TTFT p99 per router at both loads (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastroute.fleetbench.lp_share import load_over_share

#: The default policy's router name in the specs, and its 4 workers × 2 proxies variant.
DEFAULT = "fastroute"
DEFAULT_4X2 = "default-4x2"
CACHE_AWARE = "fastroute:cache-aware"
CACHE_AWARE_4X2 = "cache-aware-4x2"
WEIGHTED_HRW = "fastroute:weighted-hrw"
ROUND_ROBINS = ("fastroute:round-robin", "sglang:round_robin", "vllm-router:round_robin")
PEER_PREFIXES = ("sglang:", "vllm-router:")
#: Table order of the families.
FAMILY_ORDER = (
    "chat",
    "agentic",
    "rag",
    "hot-prompt",
    "bursts",
    "prefix-tree",
    "mooncake",
    "long-tail",
)


@dataclass(frozen=True)
class Row:
    """One router's figures on one spec."""

    family: str
    load: int  # percent
    seed: int  # MEAN_SEED: the mean over the seeds a router ran
    router: str
    status: str
    goodput: float
    ttft_p50_s: float
    ttft_p99_s: float
    tbot_p99_s: float
    hit: float
    share_max_min: float
    served_over_lp: float | None
    cpu_us_per_request: float


#: ``Row.seed`` of a router's mean over several seeds.
MEAN_SEED = -1


def _row(family: str, load: int, seed: int, result: dict[str, Any]) -> Row:
    summary = result.get("summary") or {}
    served = result.get("engine_share") or {}
    shares = list(served.values())
    return Row(
        family=family,
        load=load,
        seed=seed,
        router=result["router"],
        status=result.get("status", "?"),
        goodput=float(summary.get("slo_attainment", 0.0)),
        ttft_p50_s=float((summary.get("ttft") or {}).get("p50_s") or math.nan),
        ttft_p99_s=float((summary.get("ttft") or {}).get("p99_s") or math.nan),
        tbot_p99_s=float((summary.get("tbot") or {}).get("p99_s") or math.nan),
        hit=float(result.get("cache_hit_rate") or 0.0),
        share_max_min=(max(shares) / min(shares)) if shares and min(shares) > 0 else math.inf,
        served_over_lp=load_over_share(served, result.get("lp_share") or {}),
        cpu_us_per_request=float(result.get("router_cpu_us_per_request") or math.nan),
    )


def load_rows(*run_dirs: Path) -> list[Row]:
    """Every router of every finished spec under ``run_dirs``; a router a later directory
    ran again on the same spec and seed replaces the earlier run's row. Where a router ran
    on several seeds of a spec, a row of their means (``seed = MEAN_SEED``) is added."""
    rows: dict[tuple[str, int, int, str], Row] = {}
    for run_dir in run_dirs:
        for path in sorted(run_dir.glob("*/results.json")):
            family, _, load = path.parent.name.rpartition("-")
            if not family or not load.isdigit():
                continue
            run = json.loads(path.read_text())
            seed = int((run.get("spec") or {}).get("seed", 0))
            for result in run["results"]:
                row = _row(family, int(load), seed, result)
                rows[(row.family, row.load, row.seed, row.router)] = row
    return list(rows.values()) + _means(list(rows.values()))


def _means(rows: Sequence[Row]) -> list[Row]:
    """Per spec and router run (status ok) on several seeds, the mean of its figures."""
    groups: dict[tuple[str, int, str], list[Row]] = {}
    for r in _ok(rows):
        groups.setdefault((r.family, r.load, r.router), []).append(r)
    out = []
    for (family, load, router), runs in groups.items():
        if len(runs) < 2:
            continue
        lps = [r.served_over_lp for r in runs if r.served_over_lp is not None]
        out.append(
            Row(
                family=family,
                load=load,
                seed=MEAN_SEED,
                router=router,
                status="ok",
                goodput=_mean(r.goodput for r in runs),
                ttft_p50_s=_mean(r.ttft_p50_s for r in runs),
                ttft_p99_s=_mean(r.ttft_p99_s for r in runs),
                tbot_p99_s=_mean(r.tbot_p99_s for r in runs),
                hit=_mean(r.hit for r in runs),
                share_max_min=_mean(r.share_max_min for r in runs),
                served_over_lp=_mean(lps) if lps else None,
                cpu_us_per_request=_mean(r.cpu_us_per_request for r in runs),
            )
        )
    return out


def _mean(values: Iterable[float]) -> float:
    items = list(values)
    return math.fsum(items) / len(items)


def _ok(rows: Iterable[Row]) -> list[Row]:
    return [r for r in rows if r.status == "ok"]


def _best(rows: Sequence[Row]) -> Row | None:
    """The highest goodput; among equals, the lowest TTFT p99 (the stricter comparison)."""
    return max(rows, key=lambda r: (r.goodput, -r.ttft_p99_s), default=None)


def _is_peer(router: str) -> bool:
    return router.startswith(PEER_PREFIXES)


def _ms(seconds: float) -> str:
    return "—" if math.isnan(seconds) else f"{seconds * 1000:.0f}"


def family_table(rows: Sequence[Row], family: str) -> list[str]:
    """One family's rows: router × load."""
    lines = [
        f"#### {family}",
        "",
        "| router | load | seed | goodput | TTFT p50 / p99 ms | TBOT p99 ms | engine prefix hit "
        "| max/min engine share | served / LP share, max | router CPU µs/req |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    ordered = sorted(
        (r for r in rows if r.family == family),
        key=lambda r: (r.load, _seed_order(r.seed), _router_order(r.router)),
    )
    for r in ordered:
        if r.status != "ok":
            lines.append(f"| {r.router} | {r.load} % | {_seed(r.seed)} | {r.status} | | | | | | |")
            continue
        ratio = "∞" if math.isinf(r.share_max_min) else f"{r.share_max_min:.2f}"
        lp = "—" if r.served_over_lp is None else f"{r.served_over_lp:.2f}"
        lines.append(
            f"| {r.router} | {r.load} % | {_seed(r.seed)} | {r.goodput:.3f} | "
            f"{_ms(r.ttft_p50_s)} / {_ms(r.ttft_p99_s)} | {r.tbot_p99_s * 1000:.1f} | "
            f"{r.hit:.1%} | {ratio} | {lp} | {r.cpu_us_per_request:.0f} |"
        )
    return lines + [""]


@dataclass(frozen=True)
class Verdict:
    """The default against the acceptance figures on one spec (points = goodput × 100)."""

    family: str
    load: int
    seed: int
    default: Row
    best: Row
    best_peer: Row | None
    round_robin: Row | None
    default_4x2: Row | None
    cache_aware: Row | None
    cache_aware_4x2: Row | None
    weighted_hrw: Row | None

    @property
    def behind_best_points(self) -> float:
        return 100 * (self.best.goodput - self.default.goodput)

    @property
    def over_peer_points(self) -> float | None:
        if self.best_peer is None:
            return None
        return 100 * (self.default.goodput - self.best_peer.goodput)

    @property
    def p99_over_peer(self) -> float | None:
        if self.best_peer is None:
            return None
        peers_p99 = self.best_peer.ttft_p99_s
        return self.default.ttft_p99_s / peers_p99 if peers_p99 > 0 else None


def verdicts(rows: Sequence[Row]) -> list[Verdict]:
    """One :class:`Verdict` per spec that has the default's row."""
    out = []
    specs = sorted({(r.family, r.load, r.seed) for r in rows}, key=_spec_order)
    for family, load, seed in specs:
        spec_rows = _ok(r for r in rows if (r.family, r.load, r.seed) == (family, load, seed))
        by_name = {r.router: r for r in spec_rows}
        default = by_name.get(DEFAULT)
        if default is None:
            continue
        one_by_one = [r for r in spec_rows if r.router not in (DEFAULT_4X2, CACHE_AWARE_4X2)]
        best = _best(one_by_one)
        assert best is not None
        out.append(
            Verdict(
                family=family,
                load=load,
                seed=seed,
                default=default,
                best=best,
                best_peer=_best([r for r in spec_rows if _is_peer(r.router)]),
                round_robin=_best([r for r in spec_rows if r.router in ROUND_ROBINS]),
                default_4x2=by_name.get(DEFAULT_4X2),
                cache_aware=by_name.get(CACHE_AWARE),
                cache_aware_4x2=by_name.get(CACHE_AWARE_4X2),
                weighted_hrw=by_name.get(WEIGHTED_HRW),
            )
        )
    return out


def _spec_order(spec: tuple[str, int, int]) -> tuple[int, int, int]:
    family, load, seed = spec
    order = FAMILY_ORDER.index(family) if family in FAMILY_ORDER else len(FAMILY_ORDER)
    return order, load, _seed_order(seed)


def _seed_order(seed: int) -> int:
    """Seeds ascending, their mean last."""
    return seed if seed != MEAN_SEED else 1 << 30


def _seed(seed: int) -> str:
    return "mean" if seed == MEAN_SEED else str(seed)


def _hits(one: Row | None, four: Row | None) -> str:
    if one is None or four is None:
        return "—"
    return f"{one.hit:.1%} → {four.hit:.1%} ({100 * (four.hit - one.hit):+.1f})"


def verdict_table(items: Sequence[Verdict]) -> list[str]:
    """The acceptance figures, one row per spec."""
    lines = [
        "| family | load | seed | default | best router | default − best, points | best peer "
        "| default − best peer, points | best round robin | default − RR, points "
        "| TTFT p99 default / best peer | prefix hit 1×1 → 4×2: default | cache-aware "
        "| CPU/req default / weighted-hrw |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in items:
        peer = v.best_peer
        rr = v.round_robin
        peer_cell = "—" if peer is None else f"{peer.goodput:.3f} ({peer.router})"
        over_peer = v.over_peer_points
        p99 = v.p99_over_peer
        cpu = (
            "—"
            if v.weighted_hrw is None
            else f"{v.default.cpu_us_per_request / v.weighted_hrw.cpu_us_per_request:.2f}"
        )
        lines.append(
            f"| {v.family} | {v.load} % | {_seed(v.seed)} | {v.default.goodput:.3f} "
            f"| {v.best.goodput:.3f} "
            f"({v.best.router}) | {-v.behind_best_points:+.1f} | {peer_cell} | "
            f"{'—' if over_peer is None else f'{over_peer:+.1f}'} | "
            f"{'—' if rr is None else f'{rr.goodput:.3f} ({rr.router})'} | "
            f"{'—' if rr is None else f'{100 * (v.default.goodput - rr.goodput):+.1f}'} | "
            f"{'—' if p99 is None else f'{p99:.2f}'} | {_hits(v.default, v.default_4x2)} | "
            f"{_hits(v.cache_aware, v.cache_aware_4x2)} | {cpu} |"
        )
    return lines + [""]


def headline_rows(rows: Sequence[Row]) -> list[Row]:
    """One row per spec and router: the mean over its seeds where it ran several, else its
    lowest seed's."""
    means = {(r.family, r.load, r.router): r for r in rows if r.seed == MEAN_SEED}
    first: dict[tuple[str, int, str], Row] = {}
    for r in sorted(rows, key=lambda r: _seed_order(r.seed)):
        first.setdefault((r.family, r.load, r.router), r)
    return [means.get(key, row) for key, row in first.items()]


def plot(rows: Sequence[Row], path: Path) -> None:
    """Per family, goodput (left, zoomed to its range: most families sit near 1) and TTFT
    p99 (right, log scale) per router, a marker per load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = [f for f in FAMILY_ORDER if any(r.family == f for r in rows)]
    routers = sorted({r.router for r in rows}, key=_router_order)
    loads = sorted({r.load for r in rows})
    headline = [r for r in headline_rows(rows) if r.status == "ok"]
    n_rows = math.ceil(len(families) / 2)
    fig, axes = plt.subplots(n_rows, 4, figsize=(16, 3.0 * n_rows), squeeze=False)
    xs = range(len(routers))
    for i, family in enumerate(families):
        ax_good, ax_p99 = axes[i // 2][2 * (i % 2)], axes[i // 2][2 * (i % 2) + 1]
        for load, marker in zip(loads, "os^D", strict=False):
            found = {r.router: r for r in headline if (r.family, r.load) == (family, load)}
            good = [found[x].goodput if x in found else math.nan for x in routers]
            p99 = [found[x].ttft_p99_s if x in found else math.nan for x in routers]
            ax_good.plot(xs, good, marker, label=f"{load} %")
            ax_p99.plot(xs, p99, marker, label=f"{load} %")
        ax_good.set_title(f"{family}: goodput", fontsize=9)
        ax_p99.set_title(f"{family}: TTFT p99 (s)", fontsize=9)
        ax_p99.set_yscale("log")
        for ax in (ax_good, ax_p99):
            ax.set_xticks(list(xs))
            ax.set_xticklabels(routers, rotation=60, ha="right", fontsize=6)
            ax.grid(alpha=0.3)
            ax.axvline(0, color="grey", alpha=0.3, linewidth=6)  # the default
            ax.legend(fontsize=6)
    for ax in list(axes.flat)[2 * len(families) :]:
        ax.axis("off")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _router_order(router: str) -> tuple[int, str]:
    """The default, its 4 × 2 variant, fastroute's other policies, then the peers."""
    if router == DEFAULT:
        return 0, router
    if router == DEFAULT_4X2:
        return 1, router
    if router.startswith("fastroute:") or router.endswith("-4x2"):
        return 2, router
    return 3, router


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "run_dirs",
        type=Path,
        nargs="+",
        help="--out of fleet benchmark runs (a later one replaces a router's rows of the same "
        "seed; another seed is another sample)",
    )
    parser.add_argument("--plot", type=Path, help="write the goodput plot (PNG) here")
    args = parser.parse_args(argv)
    rows = load_rows(*args.run_dirs)
    if not rows:
        parser.error(f"no <spec>/results.json under {', '.join(map(str, args.run_dirs))}")
    lines = ["### The default against the acceptance figures", ""]
    lines += verdict_table(verdicts(rows))
    lines += ["### Per family", ""]
    for family in FAMILY_ORDER:
        if any(r.family == family for r in rows):
            lines += family_table(rows, family)
    print("\n".join(lines))
    if args.plot is not None:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
