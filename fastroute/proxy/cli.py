"""``fastroute serve``: run the routing proxy (data plane).

``fastroute serve --config FILE [--workers N]`` starts a supervisor
(:mod:`fastroute.proxy.supervisor`) that creates the host's shared stats block and runs
N worker processes (default ``proxy.workers``) on one address with ``SO_REUSEPORT``.
Each worker reads the config, attaches the stats block, builds and starts the app
(:class:`fastroute.proxy.proxy_app.ProxyApp`) and serves it on uvloop with the lean
HTTP/1.1 server of :mod:`fastroute.proxy.http.server`.

Signals (to the supervisor, which forwards them): SIGTERM/SIGINT drain — listeners
close at once, ``/health`` turns 503, in-flight requests (streams included) get
``proxy.drain_timeout_s`` to finish; SIGHUP reloads the config in every worker without
closing the listeners (:meth:`fastroute.proxy.proxy_app.ProxyApp.reload`).

Engines join and leave without a config edit through the fleet admin API
(:mod:`fastroute.proxy.admin_engines`) and ``[[discovery]]`` (DNS, resolved by the
supervisor): both write the engines state file next to the config, and every worker serves
the merged fleet (:func:`fastroute.discovery.merge.load_effective_config`), at start and on
every reload.

``--worker INDEX --supervisor-pid PID --stats-name NAME`` (internal) runs one worker.
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
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="worker processes (default: proxy.workers)",
    )
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--supervisor-pid", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--stats-name", default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; return the exit status."""
    import sys

    from fastroute.config import ConfigError, load_config
    from fastroute.discovery.merge import load_effective_config
    from fastroute.errors import TableError
    from fastroute.policy import PolicyConfigError

    try:  # a worker serves the merged fleet; the supervisor merges on its own
        config = (load_effective_config if args.worker is not None else load_config)(args.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    host = args.host if args.host is not None else config.proxy.host
    port = args.port if args.port is not None else config.proxy.port
    if not 0 <= port <= 65535:
        print(f"--port must be in 0..65535, got {port}", file=sys.stderr)
        return 2
    if args.worker is not None:
        return _run_worker(args, config, host, port)
    workers = args.workers if args.workers is not None else config.proxy.workers
    if not 1 <= workers <= 1024:
        print(f"--workers must be in 1..1024, got {workers}", file=sys.stderr)
        return 2
    try:  # fail here, once, rather than in every worker
        from fastroute.proxy.path.handler import build_policies

        build_policies(load_effective_config(args.config))  # the state file must merge too
    except PolicyConfigError as exc:
        print(f"{args.config}: {exc}", file=sys.stderr)
        return 1
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1

    from fastroute.proxy.supervisor import Supervisor, config_path_of

    supervisor = Supervisor(
        config_path_of(args.config),
        config,
        workers=workers,
        host=host,
        port=port,
        log_level=logging.getLevelName(logging.getLogger().level),
    )
    try:
        return supervisor.run()
    except (TableError, OSError) as exc:
        print(f"fastroute serve: {exc}", file=sys.stderr)
        return 1


def _run_worker(args: argparse.Namespace, config: object, host: str, port: int) -> int:
    import asyncio
    import gc
    import os
    import signal
    import sys

    import uvloop

    from fastroute.config import Config
    from fastroute.errors import TableError
    from fastroute.policy import PolicyConfigError
    from fastroute.proxy.http.server import LeanServer
    from fastroute.proxy.proxy_app import ProxyApp
    from fastroute.proxy.supervisor import set_parent_death_signal, worker_parent_alive
    from fastroute.tables.stats import StatsBlock

    assert isinstance(config, Config)
    early_hup: list[int] = []  # a SIGHUP before the loop's handler: reload once serving
    signal.signal(signal.SIGHUP, lambda signum, frame: early_hup.append(signum))
    if args.supervisor_pid is not None:
        set_parent_death_signal(signal.SIGTERM)
        if not worker_parent_alive(args.supervisor_pid):
            print("fastroute serve --worker: the supervisor is gone", file=sys.stderr)
            return 1
    try:
        stats = StatsBlock.attach(args.stats_name or config.proxy.stats_name)
    except (TableError, OSError) as exc:
        print(f"fastroute serve --worker: stats block: {exc}", file=sys.stderr)
        return 1
    try:
        try:
            app = ProxyApp(config, stats_block=stats, config_path=args.config)
        except PolicyConfigError as exc:
            print(f"{args.config}: {exc}", file=sys.stderr)
            return 1
        if args.supervisor_pid is not None:  # a fleet change reloads every worker, via it
            supervisor_pid = args.supervisor_pid
            app.fleet_admin.apply = lambda: os.kill(supervisor_pid, signal.SIGHUP)

        async def serve() -> None:
            loop = asyncio.get_running_loop()
            await app.start()
            stop = asyncio.Event()
            reloads: set[asyncio.Task[bool]] = set()

            def on_hup() -> None:
                task = loop.create_task(app.reload())
                reloads.add(task)
                task.add_done_callback(reloads.discard)

            server = LeanServer(app)
            try:
                await server.start(host, port, reuse_port=True)
                # What exists now (modules, config, tables, the app) lives as long as the
                # worker: move it out of the collector's generations, so the collections
                # the request path's allocations trigger do not traverse it (they were
                # ~5 % of a worker's CPU). A request allocates a few hundred container
                # objects, nearly all freed by reference counting: collect the young
                # generation every 10 000 allocations instead of 700 (its cost is the
                # live young objects each time, i.e. the requests in flight).
                gc.freeze()
                gc.set_threshold(10_000, 10, 10)
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.add_signal_handler(sig, stop.set)
                loop.add_signal_handler(signal.SIGHUP, on_hup)
                if early_hup:
                    on_hup()
                logger.info("worker %d (pid %d) serving on %s:%d", args.worker, _pid(), host, port)
                await stop.wait()
                logger.info("worker %d: draining", args.worker)
            finally:
                await server.drain(config.proxy.drain_timeout_s)  # stop listening, finish
                await app.stop()  # background tasks, table watcher, upstream pools
                for task in list(reloads):
                    task.cancel()

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve())
    finally:
        stats.close()
    return 0


def _pid() -> int:
    import os

    return os.getpid()
