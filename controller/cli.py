"""``fastroute controller`` / ``python -m controller``: run the control plane.

Heavy imports (aiohttp, uvloop, highspy) happen in :func:`run`, so ``fastroute --help`` stays fast.
SIGTERM / SIGINT stop listening, let a running period finish, and close the weight table without
unlinking it (proxies on this host keep the last weights; a restart continues the generations).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aiohttp import web

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
    parser.add_argument(
        "--mode", choices=("lp", "p-controller"), default="lp",
        help="control policy: the LP optimiser (default) or the legacy proportional controller "
        "(baseline for experiments; publishes its weights the same way)",
    )  # fmt: skip
    parser.add_argument(
        "--p-gain", type=float, default=0.5, metavar="K",
        help="p-controller gain K (> 0; default 0.5)",
    )  # fmt: skip
    parser.add_argument(
        "--p-ewma", type=float, default=0.5, metavar="A",
        help="p-controller EWMA factor of the latency estimate, in (0, 1] (default 0.5)",
    )  # fmt: skip


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
    from fastroute.systemd import Notifier

    log = logging.getLogger("controller")
    sd = Notifier.from_env()  # READY=1 once serving and the first period ended (systemd)
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
    if not (args.p_gain > 0 and 0 < args.p_ewma <= 1):
        print(
            f"--p-gain must be > 0 and --p-ewma in (0, 1], got {args.p_gain}, {args.p_ewma}",
            file=sys.stderr,
        )
        return 2

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        app = make_app(
            config,
            table_name=args.table,
            mode=args.mode,
            p_gain=args.p_gain,
            p_ewma_alpha=args.p_ewma,
        )
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
        await runner.setup()  # opens the table and starts the loop
        try:
            site = web.TCPSite(runner, host, port)
            await site.start()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            log.info("controller serving on %s", ", ".join(map(str, runner.addresses)))
            follow = loop.create_task(sd.follow(lambda: _systemd_status(app)))
            await stop.wait()
            log.info("controller stopping")
            sd.stopping("controller stopping")
            follow.cancel()
        finally:
            await runner.cleanup()

    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve())
    except (TableError, OSError) as exc:
        print(f"fastroute controller: {exc}", file=sys.stderr)
        return 1
    finally:
        sd.close()
    return 0


def _systemd_status(app: web.Application) -> str | None:
    """The controller's systemd STATUS= line; None until the first control period ended."""
    from controller.app import SERVICE

    svc = app[SERVICE]
    if svc.last_error is not None:
        return f"table generation {svc.generation}; last period failed: {svc.last_error}"
    if svc.plan is None:
        return None
    return f"serving; table generation {svc.generation}"
