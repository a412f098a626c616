"""``fastroute table``: inspect a shared-memory weight table."""

from __future__ import annotations

import argparse
import json
import sys
import time

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``fastroute table`` arguments."""
    sub = parser.add_subparsers(dest="table_command", metavar="ACTION", required=True)
    show = sub.add_parser("show", help="print the current generation of a table")
    show.add_argument("name", help="segment name (a file under /dev/shm)")
    show.add_argument("--json", action="store_true", help="machine-readable output")
    stale = sub.add_parser(
        "stale", help="list (and with --remove delete) tables whose writer process is gone"
    )
    stale.add_argument(
        "--min-age-s", type=float, default=0.0, help="only tables at least this old (default 0)"
    )
    stale.add_argument("--remove", action="store_true", help="delete the tables listed")


def _run_stale(args: argparse.Namespace) -> int:
    from fastroute.tables.stale import find_stale, remove_stale

    if not args.min_age_s >= 0:
        print(f"--min-age-s must be >= 0, got {args.min_age_s}", file=sys.stderr)
        return 2
    tables = find_stale(args.min_age_s)
    for t in tables:
        epoch = "none" if t.epoch is None else str(t.epoch)
        print(f"{t.name}: generation {t.generation}, {t.age_s:.1f} s old, epoch {epoch}")
    if args.remove:
        for name in remove_stale(tables):
            print(f"removed {name}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Execute ``fastroute table``; return the exit status."""
    from fastroute.errors import TableError
    from fastroute.tables import TableReader

    if args.table_command == "stale":
        return _run_stale(args)
    try:
        with TableReader(args.name, verify=True) as reader:
            snap = reader.snapshot()
    except TableError as exc:
        print(f"fastroute table: {exc}", file=sys.stderr)
        return 1
    summary = {
        "name": args.name,
        "generation": snap.generation,
        "published_at": snap.published_at,
        "age_s": round(time.time() - snap.published_at, 3),
        "n_classes": snap.n_classes,
        "n_engines": snap.n_engines,
        "retry_ratio": snap.retry_ratio,
        "engine_ids": [int(x) for x in snap.engine_ids],
        "engine_flags": [int(x) for x in snap.engine_flags],
        "class_keys": [int(x) for x in snap.class_keys],
        "shed_fraction": [float(x) for x in snap.shed_fraction],
        "weights": snap.weights.tolist(),
        "meta": snap.meta,
    }
    if args.json:
        json.dump(summary, sys.stdout, indent=2, default=str)
        print()
        return 0
    print(
        f"table {args.name!r}: generation {snap.generation}, {snap.n_classes} classes x "
        f"{snap.n_engines} engines, published {summary['age_s']} s ago, "
        f"retry ratio {snap.retry_ratio:g}"
    )
    for row in range(snap.n_classes):
        weights = snap.weights[row]
        total = weights.sum()
        share = weights / total if total > 0 else weights
        top = sorted(range(snap.n_engines), key=lambda e: -share[e])[:5]
        tops = ", ".join(f"{int(snap.engine_ids[e]):#x}={share[e]:.3f}" for e in top)
        print(
            f"  class {int(snap.class_keys[row]):#x}: shed {snap.shed_fraction[row]:.3f}; "
            f"top shares {tops}"
        )
    return 0
