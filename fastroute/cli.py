"""The ``fastroute`` command line.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``. Those modules keep heavy imports (aiohttp, highspy) inside
``run`` so that ``fastroute --help`` stays fast and ``fastroute`` never imports
``controller`` unless the controller subcommand runs.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from fastroute._version import __version__

__all__ = ["main"]

#: subcommand -> (module implementing it, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("fastroute.proxy.cli", "run the routing proxy (data plane)"),
    # Loaded by name only: fastroute never imports controller at module level (DESIGN §6).
    "controller": ("controller.cli", "run the control plane (LP weights, /v1/table, /v1/plan)"),
    "engine": ("fastroute.emulator.cli", "run emulated vLLM-compatible engines on loopback"),
    "table": ("fastroute.tables.cli", "inspect a shared-memory weight table"),
    "demo": ("fastroute.demo.cli", "run the whole system on loopback with emulated engines"),
    "sim": ("fastroute.sim.cli", "simulate routing policies on a virtual fleet (scenarios)"),
    "bench": ("fastroute.fleetbench.cli", "benchmark routers side by side on an emulated fleet"),
}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastroute", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"fastroute {__version__}")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            # The module, or a parent package of it, is absent: not built yet.
            if exc.name is None or not (module_name + ".").startswith(exc.name + "."):
                raise
            continue  # subcommand not built yet
        command = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(command)
        command.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``fastroute`` command line; return the process exit status."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
