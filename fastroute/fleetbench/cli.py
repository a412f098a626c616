"""``fastroute bench fleet SPEC.toml``: routers side by side on an emulated fleet.

Runs the spec's workload through each router in turn (a fresh fleet each time),
then prints a markdown table and writes ``results.json``, ``results.md``, each router's
request records (``records/<router>.jsonl``) and, with ``--plots`` when matplotlib is
installed, ``ttft_cdf.png`` into ``--out``. Given
several specs, it runs them one after the other into ``--out/<spec name>/`` and adds
``--out/summary.md``: goodput per spec (row) and router (column).
Exit status: 0 when every available router ran to the end, 1 when one failed to
start or died, 2 for a bad spec. Heavy imports happen in :func:`run`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastroute.fleetbench.runner import RouterResult
    from fastroute.fleetbench.spec import BenchSpec

__all__ = ["add_arguments", "overridden", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``fastroute bench``'s actions."""
    sub = parser.add_subparsers(dest="bench_command", metavar="ACTION", required=True)
    fleet = sub.add_parser("fleet", help="run a fleet benchmark spec (TOML)")
    fleet.add_argument(
        "spec", nargs="+",
        help="benchmark spec(s), e.g. examples/bench/chat-90.toml; with several, each runs in "
        "turn into --out/<name>/ and --out/summary.md has one goodput table for all",
    )  # fmt: skip
    fleet.add_argument(
        "--routers", nargs="+", metavar="NAME",
        help="override the spec's routers (fastroute[:policy], sglang:POLICY, ...)",
    )  # fmt: skip
    fleet.add_argument("--duration", type=float, metavar="S", help="override duration_s")
    fleet.add_argument(
        "--seed", type=int, metavar="N",
        help="override the spec's seed (the workload's sessions and the engines' seeds): "
        "a second sample of the same spec",
    )  # fmt: skip
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
    _add_chaos(sub)


def _add_chaos(sub: argparse._SubParsersAction) -> None:
    from fastroute.fleetbench.chaos_faults import FAULT_KINDS

    chaos = sub.add_parser(
        "chaos", help="steady load on an emulated fleet while a seeded schedule injects faults",
    )  # fmt: skip
    chaos.add_argument("--duration-s", type=float, default=600.0, help="default 600")
    chaos.add_argument("--seed", type=int, default=0, help="schedule seed (default 0)")
    chaos.add_argument("--engines", type=int, default=4, help="emulated engines (default 4)")
    chaos.add_argument("--concurrency", type=int, default=6, help="closed-loop clients (default 6)")
    chaos.add_argument("--max-tokens", type=int, default=160, help="per request (default 160)")
    chaos.add_argument(
        "--kinds", nargs="+", default=list(FAULT_KINDS), choices=FAULT_KINDS, metavar="KIND",
        help=f"fault kinds (default all: {' '.join(FAULT_KINDS)})",
    )  # fmt: skip
    chaos.add_argument("--gap-s", type=float, default=10.0, help="calm between faults (10)")
    chaos.add_argument(
        "--soak", action="store_true",
        help="sample every process's RSS, fds and event-loop tasks every 10 s and fit their "
        "slopes; each request on a new connection (use with a long --duration-s and a large "
        "--gap-s: faults at a low rate)",
    )  # fmt: skip
    chaos.add_argument("--out", default="bench-results/chaos", help="output directory")


def _chaos(args: argparse.Namespace) -> int:
    """Run ``fastroute bench chaos``; 0 when the verdict is pass, 1 when fail."""
    import asyncio
    from pathlib import Path

    from fastroute.fleetbench.chaos import ChaosOptions, markdown, run_chaos

    options = ChaosOptions(
        duration_s=args.duration_s, seed=args.seed, engines=args.engines,
        concurrency=args.concurrency, max_tokens=args.max_tokens, kinds=tuple(args.kinds),
        gap_s=args.gap_s, sample_interval_s=10.0 if args.soak else None,
        fresh_connections=args.soak,
    )  # fmt: skip
    try:
        summary = asyncio.run(run_chaos(options, Path(args.out)))
    except ValueError as exc:
        print(f"fastroute bench chaos: {exc}", file=sys.stderr)
        return 2
    print(markdown(summary), flush=True)
    return 0 if summary["verdict"] == "pass" and not summary.get("leaks") else 1


def overridden(
    specs: list[BenchSpec], duration_s: float | None = None, seed: int | None = None
) -> list[BenchSpec]:
    """The specs with ``--duration`` and ``--seed`` applied (None: the spec's own).

    Raises
    ------
    BenchSpecError
        ``duration_s`` not > 0 or ``seed`` negative.
    """
    import msgspec

    from fastroute.fleetbench.spec import BenchSpecError

    changes: dict[str, float | int] = {}
    if duration_s is not None:
        if not duration_s > 0:
            raise BenchSpecError(f"--duration must be > 0, got {duration_s}")
        changes["duration_s"] = duration_s
    if seed is not None:
        if seed < 0:
            raise BenchSpecError(f"--seed must be >= 0, got {seed}")
        changes["seed"] = seed
    return [msgspec.structs.replace(s, **changes) for s in specs]


def run(args: argparse.Namespace) -> int:
    """Run ``fastroute bench``; return the exit status."""
    from fastroute.fleetbench.spec import BenchSpecError, load_spec

    if args.bench_command == "chaos":
        return _chaos(args)

    paths = args.spec if isinstance(args.spec, list) else [args.spec]
    try:
        specs = [load_spec(path) for path in paths]
        if args.bench_command == "capacity":
            return _capacity(specs[0], args.attainment)
        specs = overridden(specs, duration_s=args.duration, seed=args.seed)
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise BenchSpecError(f"several specs share a name: {names} (one output dir each)")
    except BenchSpecError as exc:
        print(f"fastroute bench: {exc}", file=sys.stderr)
        return 2
    return _run_specs(specs, args)


def _run_specs(specs: list[BenchSpec], args: argparse.Namespace) -> int:
    """Run every spec in turn; with several, each writes to ``--out/<name>`` and an
    aggregate goodput table goes to ``--out/summary.md``."""
    import asyncio
    import signal
    import tempfile
    from pathlib import Path

    from fastroute.fleetbench import report
    from fastroute.fleetbench.runner import run_bench

    out = Path(args.out)
    command = "fastroute bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    async def main(tmp: Path, spec: BenchSpec, records: dict[str, list]) -> list[RouterResult]:
        # Explicit handlers: a shell starts background jobs with SIGINT ignored.
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        return await run_bench(spec, tmp, routers=args.routers, say=say, records_out=records)

    done: list[tuple[BenchSpec, list[RouterResult]]] = []
    for spec in specs:
        spec_out = out / spec.name if len(specs) > 1 else out
        spec_out.mkdir(parents=True, exist_ok=True)
        records: dict[str, list] = {}
        if len(specs) > 1:
            say(f"== {spec.name} ==")
        try:
            with tempfile.TemporaryDirectory(prefix="fastroute-bench-") as tmp:
                results = asyncio.run(main(Path(tmp), spec, records))
        except ValueError as exc:  # unknown router name, unusable trace
            print(f"fastroute bench: {spec.name}: {exc}", file=sys.stderr)
            return 2
        except (KeyboardInterrupt, asyncio.CancelledError):
            print("fastroute bench: interrupted; every process was stopped", file=sys.stderr)
            return 130
        machine = report.machine_description()
        text = report.markdown_report(spec, results, machine, command)
        (spec_out / "results.md").write_text(text)
        report.write_json(spec_out / "results.json", spec, results, machine, command)
        print(text, flush=True)
        say(report.write_records(spec_out, records))
        if args.plots:
            say(report.write_plots(spec_out, results, records))
        say(f"written: {spec_out / 'results.md'}, {spec_out / 'results.json'}")
        done.append((spec, results))
    if len(specs) > 1:
        summary = report.aggregate_report(done, command)
        (out / "summary.md").write_text(summary)
        print(summary)
        say(f"written: {out / 'summary.md'}")
    failed = [r for _, results in done for r in results if r.status not in ("ok", "unavailable")]
    return 1 if failed else 0


def _capacity(spec: object, attainment: float) -> int:
    """Print the estimated capacity of each profile in the spec's fleet."""
    from fastroute.fleetbench.capacity import slo_capacity_rps
    from fastroute.fleetbench.spec import BenchSpec
    from fastroute.workload import ChatWorkload

    assert isinstance(spec, BenchSpec)
    if spec.family is not None:
        from fastroute.fleetbench.families import saturation_capacity

        for profile in dict.fromkeys(g.profile for g in spec.fleet.groups):
            rps = saturation_capacity(spec, profile)
            declared = sorted({g.capacity_rps for g in spec.fleet.groups if g.profile == profile})
            print(
                f"{profile}: {rps:.2f} req/s saturation capacity without prefix reuse (the "
                f"simulator's target_load unit; spec declares capacity_rps {declared})"
            )
        return 0
    if spec.workload is None:
        print("fastroute bench capacity: the spec has no [workload] (a [replay] spec states "
              "its rate; see docs/fleet-benchmark.md)", file=sys.stderr)  # fmt: skip
        return 2
    if not 0 < attainment <= 1:
        print(f"fastroute bench: --attainment must be in (0, 1], got {attainment}", file=sys.stderr)
        return 2
    workload = ChatWorkload.from_dict(spec.workload)
    for profile in dict.fromkeys(g.profile for g in spec.fleet.groups):
        rps = slo_capacity_rps(
            profile, workload, ttft_slo_s=spec.slo.ttft_s, tbot_slo_s=spec.slo.tbot_s,
            attainment=attainment, seed=spec.seed,
        )  # fmt: skip
        declared = sorted({g.capacity_rps for g in spec.fleet.groups if g.profile == profile})
        print(f"{profile}: {rps:.2f} req/s at {attainment:.0%} SLO attainment "
              f"(spec declares capacity_rps {declared})")  # fmt: skip
    return 0
