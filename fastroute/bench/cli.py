"""``fastroute bench fleet SPEC.toml``: routers side by side on an emulated fleet.

Runs the spec's workload through each router in turn (a fresh fleet each time),
then prints a markdown table and writes ``results.json`` and ``results.md`` (and
``ttft_cdf.png`` with ``--plots`` when matplotlib is installed) into ``--out``.
Exit status: 0 when every available router ran to the end, 1 when one failed to
start or died, 2 for a bad spec. Heavy imports happen in :func:`run`.
"""

from __future__ import annotations

import argparse
import shlex
import sys

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``fastroute bench``'s actions."""
    sub = parser.add_subparsers(dest="bench_command", metavar="ACTION", required=True)
    fleet = sub.add_parser("fleet", help="run a fleet benchmark spec (TOML)")
    fleet.add_argument("spec", help="benchmark spec, e.g. examples/bench/chat-90.toml")
    fleet.add_argument(
        "--routers", nargs="+", metavar="NAME",
        help="override the spec's routers (fastroute[:policy], sglang:POLICY, ...)",
    )  # fmt: skip
    fleet.add_argument("--duration", type=float, metavar="S", help="override duration_s")
    fleet.add_argument("--out", default="bench-results", help="output directory")
    fleet.add_argument("--plots", action="store_true", help="also write PNG plots")
    cap = sub.add_parser(
        "capacity",
        help="estimate each engine profile's capacity (req/s) for a spec's workload and SLOs",
    )
    cap.add_argument("spec", help="benchmark spec (its [workload], [slo] and fleet profiles)")
    cap.add_argument(
        "--attainment", type=float, default=0.9,
        help="share of requests that must meet both SLOs (default 0.9)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Run ``fastroute bench``; return the exit status."""
    import asyncio
    import signal
    import tempfile
    from pathlib import Path

    import msgspec

    from fastroute.bench import report
    from fastroute.bench.runner import run_bench
    from fastroute.bench.spec import BenchSpecError, load_spec

    try:
        spec = load_spec(args.spec)
        if args.bench_command == "capacity":
            return _capacity(spec, args.attainment)
        if args.duration is not None:
            if not args.duration > 0:
                raise BenchSpecError(f"--duration must be > 0, got {args.duration}")
            spec = msgspec.structs.replace(spec, duration_s=args.duration)
    except BenchSpecError as exc:
        print(f"fastroute bench: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "fastroute bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    records: dict[str, list] = {}

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    async def main(tmp: Path) -> list:
        # Explicit handlers: a shell starts background jobs with SIGINT ignored.
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        return await run_bench(spec, tmp, routers=args.routers, say=say, records_out=records)

    try:
        with tempfile.TemporaryDirectory(prefix="fastroute-bench-") as tmp:
            results = asyncio.run(main(Path(tmp)))
    except ValueError as exc:  # unknown router name
        print(f"fastroute bench: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("fastroute bench: interrupted; every process was stopped", file=sys.stderr)
        return 130
    machine = report.machine_description()
    text = report.markdown_report(spec, results, machine, command)
    (out / "results.md").write_text(text)
    report.write_json(out / "results.json", spec, results, machine, command)
    print(text)
    if args.plots:
        say(report.write_plots(out, results, records))
    say(f"written: {out / 'results.md'}, {out / 'results.json'}")
    failed = [r for r in results if r.status not in ("ok", "unavailable")]
    return 1 if failed else 0


def _capacity(spec: object, attainment: float) -> int:
    """Print the estimated capacity of each profile in the spec's fleet."""
    from fastroute.bench.capacity import engine_capacity_rps
    from fastroute.bench.spec import BenchSpec
    from fastroute.workload import ChatWorkload

    assert isinstance(spec, BenchSpec)
    if not 0 < attainment <= 1:
        print(f"fastroute bench: --attainment must be in (0, 1], got {attainment}", file=sys.stderr)
        return 2
    workload = ChatWorkload.from_dict(spec.workload)
    for profile in dict.fromkeys(g.profile for g in spec.fleet.groups):
        rps = engine_capacity_rps(
            profile, workload, ttft_slo_s=spec.slo.ttft_s, tbot_slo_s=spec.slo.tbot_s,
            attainment=attainment, seed=spec.seed,
        )  # fmt: skip
        declared = sorted({g.capacity_rps for g in spec.fleet.groups if g.profile == profile})
        print(f"{profile}: {rps:.2f} req/s at {attainment:.0%} SLO attainment "
              f"(spec declares capacity_rps {declared})")  # fmt: skip
    return 0
