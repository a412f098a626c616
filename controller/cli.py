"""``fastroute controller`` / ``python -m controller``: run the control plane.

Heavy imports (aiohttp, uvloop, highspy) happen in :func:`run`, so ``fastroute --help`` stays fast.
SIGTERM / SIGINT stop listening, let a running period finish, and close the weight table without
unlinking it (proxies on this host keep the last weights; a restart continues the generations).
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the controller's options to ``parser``."""
    parser.add_argument("--config", required=True, help="the fastroute TOML config file")
    parser.add_argument(
        "--table", default=None, metavar="NAME",
        help="shared-memory weight table to write (default: proxy.table_name)",
    )  # fmt: skip
    parser.add_argument("--host", default=None, help="listen address (default controller.host)")
    parser.add_argument("--port", type=int, default=None, help="port (default controller.port)")


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; return the exit status."""
    import asyncio
    import logging
    import signal

    import uvloop
    from aiohttp import web

    from controller.app import make_app
    from fastroute.config import ConfigError, load_config
    from fastroute.errors import TableError

    log = logging.getLogger("controller")
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    host = args.host if args.host is not None else config.controller.host
    port = args.port if args.port is not None else config.controller.port
    if not 0 <= port <= 65535:
        print(f"--port must be in 0..65535, got {port}", file=sys.stderr)
        return 2

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        app = make_app(config, table_name=args.table)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
        await runner.setup()  # opens the table and starts the loop
        try:
            site = web.TCPSite(runner, host, port)
            await site.start()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            log.info("controller serving on %s", ", ".join(map(str, runner.addresses)))
            await stop.wait()
            log.info("controller stopping")
        finally:
            await runner.cleanup()

    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve())
    except (TableError, OSError) as exc:
        print(f"fastroute controller: {exc}", file=sys.stderr)
        return 1
    return 0
