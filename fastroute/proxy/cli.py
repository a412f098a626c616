"""``fastroute serve``: run the routing proxy (data plane), one worker process.

Reads the config, builds the app (:func:`fastroute.proxy.app.make_app`) and serves it
on uvloop. SIGTERM/SIGINT drain: the listener closes at once, ``/health`` turns 503,
and in-flight requests (streams included) get ``proxy.drain_timeout_s`` to finish.
"""

from __future__ import annotations

import argparse
import logging

__all__ = ["add_arguments", "run"]

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``serve``'s options on ``parser``."""
    parser.add_argument("--config", required=True, metavar="FILE", help="TOML config file")
    parser.add_argument("--host", default=None, help="listen address (default: proxy.host)")
    parser.add_argument("--port", type=int, default=None, help="listen port (default: proxy.port)")


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; return the exit status."""
    import sys

    import uvloop
    from aiohttp import web

    from fastroute.config import ConfigError, load_config
    from fastroute.policy import PolicyConfigError
    from fastroute.proxy.app import make_app

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    if config.proxy.workers > 1:
        logger.warning(
            "proxy.workers = %d: this version runs one worker process", config.proxy.workers
        )
    try:
        app = make_app(config)
    except PolicyConfigError as exc:
        print(f"{args.config}: {exc}", file=sys.stderr)
        return 1
    host = args.host if args.host is not None else config.proxy.host
    port = args.port if args.port is not None else config.proxy.port
    if not 0 <= port <= 65535:
        print(f"--port must be in 0..65535, got {port}", file=sys.stderr)
        return 2
    web.run_app(
        app,
        host=host,
        port=port,
        shutdown_timeout=config.proxy.drain_timeout_s,
        handler_cancellation=True,
        access_log=None,
        print=lambda text: logger.info("%s", text.strip()),
        loop=uvloop.new_event_loop(),
    )
    return 0
