"""The benchmark's outputs: JSON, a markdown table with the machine, optional PNG plots."""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import msgspec

from fastroute.fleetbench.lp_share import load_over_share
from fastroute.fleetbench.replay import describe_mix
from fastroute.fleetbench.runner import RouterResult, target_rps
from fastroute.fleetbench.spec import BenchSpec

__all__ = [
    "machine_description",
    "markdown_report",
    "goodput_table",
    "aggregate_report",
    "write_json",
    "write_plots",
]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine_description() -> dict[str, Any]:
    """Host, CPU, cores, memory, Python and the routers' package versions."""
    mem_gib = None
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        mem_gib = round(pages / 2**30, 1)
    except (ValueError, OSError):
        pass
    return {
        "host": platform.node(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "memory_gib": mem_gib,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "versions": {
            name: _version(name)
            for name in ("fastroute", "sglang-router", "vllm-router", "aiohttp", "uvloop")
        },
    }


def _ms(v: float | None, digits: int = 0) -> str:
    return "—" if v is None else f"{v * 1e3:.{digits}f}"


def _num(v: float | None, digits: int = 1) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v * 100:.1f}%"


def markdown_report(
    spec: BenchSpec, results: Sequence[RouterResult], machine: dict[str, Any], command: str
) -> str:
    """The results as markdown: machine and command, the main table, per-engine shares."""
    m = machine
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v)
    if spec.replay is not None:
        rate = f"open loop at {target_rps(spec):.2f} req/s mean"
        mode = f"trace replay ({describe_mix(spec)}), {rate}"
        if spec.load is not None:
            mode += f" ({spec.load:g} × nominal capacity)"
    elif spec.family is not None:
        from fastroute.fleetbench.families import describe_family

        mode = f"family {describe_family(spec)}, open loop at {target_rps(spec):.2f} req/s mean"
        if spec.load is not None:
            mode += f" ({spec.load:g} × nominal capacity)"
    elif spec.load is not None:
        mode = (
            f"open loop at {spec.load:g} × nominal capacity "
            f"({spec.load * spec.fleet.capacity_rps():.1f} req/s)"
        )
    else:
        mode = f"closed loop, {spec.concurrency} sessions"
    lines = [
        f"## Fleet benchmark: {spec.name}",
        "",
        spec.description.strip(),
        "",
        f"Machine: {m['cpu']}, {m['cpus']} CPUs, {m['memory_gib']} GiB, {m['os']}, "
        f"Python {m['python']} ({versions}). Client, routers and emulated engines share it.",
        f"Command: `{command}`",
        f"Workload: {mode}, {spec.duration_s:g} s measured per router after "
        f"{spec.warmup_s:g} s of warm-up (+ ≤ {spec.drain_s:g} s drain), "
        f"seed {spec.seed}, {'streaming' if spec.stream else 'non-streaming'}, session id "
        f"header {'sent' if spec.send_session_id else 'not sent'}; SLO TTFT ≤ "
        f"{spec.slo.ttft_s:g} s, TBOT ≤ {spec.slo.tbot_s:g} s.",
        "",
        "| router | status | req ok / sent (req/s) | TTFT p50 / p90 / p99 ms | TBOT p50 / p99 ms "
        "| e2e p50 / p99 ms | SLO met | goodput req/s | errors | prefix-cache hit "
        "| router CPU µs/req | µs/token | peak RSS MB | added TTFT p50 ms (c=1) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s = r.summary
        if s is None:
            lines.append(f"| {r.router} | {r.status}: {r.detail[:120]} |" + " |" * 12)
            continue
        errors = ", ".join(f"{k} {v}" for k, v in s.errors.items()) or "0"
        status = r.status if r.status == "ok" else f"**{r.status}**"
        lines.append(
            f"| {r.router} | {status} | {s.ok} / {s.requests} ({_num(r.offered_rps, 1)}) "
            f"| {_ms(s.ttft.p50_s)} / {_ms(s.ttft.p90_s)} / {_ms(s.ttft.p99_s)} "
            f"| {_ms(s.tbot.p50_s, 1)} / {_ms(s.tbot.p99_s, 1)} "
            f"| {_ms(s.e2e.p50_s)} / {_ms(s.e2e.p99_s)} | {_pct(s.slo_attainment)} "
            f"| {_num(s.goodput_rps, 2)} | {errors} | {_pct(r.cache_hit_rate)} "
            f"| {_num(r.router_cpu_us_per_request, 0)} | {_num(r.router_cpu_us_per_token, 1)} "
            f"| {_num(r.router_peak_rss_mb, 0)} | {_num(r.overhead_added_p50_ms, 2)} |"
        )
    lines += ["", *goodput_table(results)]
    engines = sorted({e for r in results for e in r.engine_share})
    if engines:
        lines += [
            "",
            "Per-engine request share (engine `/metrics`) and prefix-cache hit rate; max/min "
            "of the shares; the largest share / the engine's mean LP share (fastroute with "
            "its controller):",
            "",
            "| router | " + " | ".join(engines) + " | max/min | served / LP share, max |",
            "|---|" + "---|" * (len(engines) + 2),
        ]
        for r in results:
            if not r.engine_share:
                continue
            cells = [
                f"{r.engine_share.get(e, 0.0) * 100:.0f}% ({_pct(r.engine_cache_hit_rate.get(e))})"
                for e in engines
            ]
            shares = [r.engine_share.get(e, 0.0) for e in engines]
            spread = max(shares) / min(shares) if min(shares) > 0 else None
            cells += [_num(spread, 2), _num(load_over_share(r.engine_share, r.lp_share), 2)]
            lines.append(f"| {r.router} | " + " | ".join(cells) + " |")
    notes = [f"- {r.router}: {r.detail}" for r in results if r.detail and r.status == "ok"]
    if notes:
        lines += ["", "Notes:", *notes]
    return "\n".join(lines) + "\n"


def _count_429(errors: dict[str, int]) -> int:
    return errors.get("http_429", 0)


def _429_cell(n429: int, by_code: dict[str, int]) -> str:
    """``n`` and, when there were any, their split by error code: ``19 (load_shed 19)``."""
    if not n429 or not by_code:
        return str(n429)
    return f"{n429} (" + ", ".join(f"{code} {n}" for code, n in by_code.items()) + ")"


def goodput_table(results: Sequence[RouterResult]) -> list[str]:
    """Per router: goodput (SLO attainment; 429s, errors and cut-off requests count as
    misses), p99 TTFT and TBOT, requests sent, 429s split by their body's error code (the
    controller's ``load_shed``, the queue guard's ``overloaded``, early ``slo_infeasible``
    rejections, an engine's queue-full ``429``) and other errors, as markdown lines."""
    lines = [
        "Goodput (share of requests sent meeting both SLOs; 429s and errors are misses):",
        "",
        "| router | goodput | TTFT p99 ms | TBOT p99 ms | sent | 429 | other errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s = r.summary
        if s is None:
            lines.append(f"| {r.router} | {r.status} | — | — | — | — | — |")
            continue
        n429 = _count_429(s.errors)
        other = sum(s.errors.values()) - n429
        lines.append(
            f"| {r.router} | {_num(s.slo_attainment, 3)} | {_ms(s.ttft.p99_s)} "
            f"| {_ms(s.tbot.p99_s, 1)} | {s.requests} | {_429_cell(n429, s.rejects_429)} "
            f"| {other} |"
        )
    return lines


def aggregate_report(runs: Sequence[tuple[BenchSpec, Sequence[RouterResult]]], command: str) -> str:
    """One goodput table over several specs: a row per spec, a column per router.

    A cell is the SLO attainment (share of requests sent meeting both SLOs), then the
    429s among the requests sent, or the router's status when it did not run.
    """
    routers = list(dict.fromkeys(r.router for _, results in runs for r in results))
    lines = [
        "## Fleet benchmark: goodput per spec and router",
        "",
        f"Command: `{command}`",
        "",
        "Goodput = share of requests sent meeting both SLOs (429s, errors and requests cut "
        "at the drain count as misses); in brackets: 429s / requests sent.",
        "",
        "| spec | " + " | ".join(routers) + " |",
        "|---|" + "---|" * len(routers),
    ]
    for spec, results in runs:
        by = {r.router: r for r in results}
        cells = []
        for name in routers:
            r = by.get(name)
            if r is None:
                cells.append("")
            elif r.summary is None:
                cells.append(r.status)
            else:
                s = r.summary
                cells.append(f"{_num(s.slo_attainment, 3)} ({_count_429(s.errors)}/{s.requests})")
        lines.append(f"| {spec.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_json(
    path: Path,
    spec: BenchSpec,
    results: Sequence[RouterResult],
    machine: dict[str, Any],
    command: str,
) -> None:
    """Write everything (spec, machine, command, results) as JSON."""
    doc = {"spec": spec, "machine": machine, "command": command, "results": list(results)}
    path.write_bytes(msgspec.json.format(msgspec.json.encode(doc), indent=2) + b"\n")


def write_records(out_dir: Path, records: dict[str, list[Any]]) -> str:
    """Each router's measured-window request records as ``records/<router>.jsonl``.

    One :class:`~fastroute.loadgen.records.RequestRecord` per line, as the client saw it
    (engine, latencies, prompt and cached tokens, error code): what a tail is made of,
    for reading after the run. Return what was written.
    """
    folder = out_dir / "records"
    folder.mkdir(exist_ok=True)
    written = []
    for router, recs in records.items():
        path = folder / f"{router.replace('/', '_')}.jsonl"
        path.write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in recs))
        written.append(f"{path.name} ({len(recs)})")
    return f"records: {folder} " + ", ".join(written)


def write_plots(
    out_dir: Path,
    results: Sequence[RouterResult],
    records: dict[str, list[Any]],
    bin_s: float = 5.0,
) -> str:
    """PNG plots into ``out_dir``; return what was done.

    ``ttft_cdf.png``: the client-side TTFT CDF of each router; ``engine_share.png``: per
    router, each engine's share of the requests sent in each ``bin_s`` window (from the
    ``x-fastroute-engine`` header). matplotlib is imported here, only when plots are
    asked for; without it the plots are skipped with a note (fastroute does not depend
    on it).
    """
    try:
        import matplotlib  # type: ignore[import-not-found]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found]
    except ImportError:
        return "plots skipped: matplotlib is not installed (pip install matplotlib)"
    ran = [r for r in results if records.get(r.router)]
    if not ran:
        return "plots skipped: no router produced records"
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in ran:
        values = sorted(x.ttft_s for x in records[r.router] if x.ok and x.ttft_s is not None)
        if values:
            n = len(values)
            ax.step([v * 1e3 for v in values], [(i + 1) / n for i in range(n)], where="post",
                    label=r.router)  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, client side)")
    ax.set_ylabel("fraction of requests")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    cdf = out_dir / "ttft_cdf.png"
    fig.savefig(cdf, dpi=100, bbox_inches="tight")
    plt.close(fig)

    fig, axes = plt.subplots(len(ran), 1, figsize=(7, 2.2 * len(ran)), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], ran, strict=True):
        recs = [x for x in records[r.router] if x.engine is not None]
        engines = sorted({x.engine for x in recs})
        t0 = min((x.sent_at_s for x in recs), default=0.0)
        n_bins = int(max((x.sent_at_s for x in recs), default=t0) - t0) // int(bin_s) + 1
        counts = {e: [0] * n_bins for e in engines}
        for x in recs:
            counts[x.engine][int((x.sent_at_s - t0) // bin_s)] += 1
        totals = [sum(counts[e][i] for e in engines) or 1 for i in range(n_bins)]
        xs = [i * bin_s for i in range(n_bins)]
        shares = [[counts[e][i] / totals[i] for i in range(n_bins)] for e in engines]
        ax.stackplot(xs, shares, labels=engines, step="post")
        ax.set_ylim(0, 1)
        ax.set_ylabel("share")
        ax.set_title(r.router, fontsize=9)
    axes[0, 0].legend(loc="upper right", fontsize=7, ncol=min(4, len(axes[0, 0].lines) or 4))
    axes[-1, 0].set_xlabel(f"seconds into the measured window ({bin_s:g} s bins)")
    share = out_dir / "engine_share.png"
    fig.savefig(share, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return f"plots written: {cdf}, {share}"
