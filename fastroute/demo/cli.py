"""``fastroute demo``: run the whole system on loopback with emulated engines.

Starts an emulated fleet in two regions (4 H100-class engines in ``us-east``, 4
A40-class in ``eu-west``, two models), the controller and one proxy per source
cluster; drives ``--duration`` seconds of multi-turn chat from both clusters; prints
per-engine shares, latencies and cache hit rates, the totals and the URLs to look at;
then stops every process it started and removes its shared memory. Heavy imports
happen in :func:`run`.
"""

from __future__ import annotations

import argparse
import logging

__all__ = ["add_arguments", "run"]


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``fastroute demo``'s options."""
    parser.add_argument(
        "--duration", type=_positive, default=60.0, metavar="S",
        help="seconds of traffic (default 60)",
    )  # fmt: skip
    parser.add_argument(
        "--keep", action="store_true",
        help="leave everything running after the summary (Ctrl-C stops it)",
    )  # fmt: skip
    parser.add_argument(
        "--fault", choices=["slow", "errors"], default=None,
        help="halfway, slow one engine 3x (slow) or fail half its requests (errors)",
    )  # fmt: skip
    parser.add_argument(
        "--fault-engine", default="h100-llama-0", metavar="NAME",
        help="the engine --fault hits (default h100-llama-0)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument(
        "--rate", type=_positive, default=6.0, metavar="SESSIONS_PER_S",
        help="chat sessions started per second, both clusters together (default 6)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Run the demo; return the exit status."""
    from fastroute.demo.runner import DemoOptions, run_demo

    level = logging.getLevelName(logging.getLogger().level)
    options = DemoOptions(
        duration_s=args.duration,
        keep=args.keep,
        fault=args.fault,
        fault_engine=args.fault_engine,
        seed=args.seed,
        rate_sessions_per_s=args.rate,
        log_level="WARNING" if level == "INFO" else level,
    )
    return run_demo(options)
