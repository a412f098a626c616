"""``fastroute controller`` / ``python -m controller``: run the control plane.

Heavy imports (aiohttp, uvloop, highspy) happen in :func:`run`, so ``fastroute --help`` stays fast.
SIGTERM / SIGINT stop listening, let a running period finish, and close the weight table without
unlinking it (proxies on this host keep the last weights; a restart continues the generations).

SIGHUP re-reads ``--config`` (systemd ``ExecReload=``) without closing the listener:
``RELOADING=1`` is sent, the file is loaded and validated, and
:meth:`controller.service.ControllerService.reload` switches the service to it between two
periods (same table, generations keep increasing, long-polls stay parked). An invalid file is
logged (file and JSON path) and counted in ``fastroute_controller_config_reloads_total{result=
"error"}``, and the controller keeps running on the config it has. A changed listen address
(``controller.host`` / ``controller.port``, unless given on the command line) or table name is
logged as needing a restart and the old value kept. ``READY=1`` follows in every case, with a
``STATUS=`` that says how the reload went. Signals arriving during a reload coalesce into one more.

The fleet is the proxy's: the config's engines merged with the engines state file
(``<config>.engines.json``: admin API engines, drain marks, DNS-discovered engines;
:func:`fastroute.discovery.merge.load_effective_config`). A change of that file triggers the
same reload (checked every :data:`ENGINES_STATE_POLL_S`).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio

    from aiohttp import web

    from controller.options import ControllerOptions
    from fastroute.config import Config
    from fastroute.systemd import Notifier

__all__ = ["add_arguments", "run", "ENGINES_STATE_POLL_S"]

#: How often the controller checks the engines state file for a fleet change, seconds.
ENGINES_STATE_POLL_S = 1.0


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
        "--etcd", default=None, metavar="URL[,URL...]",
        help="run as one of several controllers: campaign on these etcd members "
        "(default controller.ha.etcd_urls; none: a single controller)",
    )  # fmt: skip
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

    import uvloop

    from controller.options import ControllerOptions
    from fastroute.config import ConfigError
    from fastroute.discovery.merge import load_effective_config
    from fastroute.errors import TableError
    from fastroute.systemd import Notifier

    sd = Notifier.from_env()  # READY=1 once serving and the first period ended (systemd)
    try:
        config = load_effective_config(args.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    if args.etcd is not None:
        try:
            config = _with_etcd(config, args.etcd)
        except ValueError as exc:
            print(f"--etcd: {exc}", file=sys.stderr)
            return 2
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
    options = ControllerOptions(
        table_name=args.table, mode=args.mode, p_gain=args.p_gain, p_ewma_alpha=args.p_ewma
    )
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(_serve(config, options, args, (host, port), sd))
    except (TableError, OSError) as exc:
        print(f"fastroute controller: {exc}", file=sys.stderr)
        return 1
    finally:
        sd.close()
    return 0


async def _serve(
    config: Config,
    options: ControllerOptions,
    args: argparse.Namespace,
    listening: tuple[str, int],
    sd: Notifier,
) -> None:
    """Serve ``make_app(config, options)`` on ``listening`` until SIGTERM/SIGINT; SIGHUP
    reloads ``args.config``."""
    import asyncio
    import contextlib
    import logging
    import signal

    from aiohttp import web

    from controller.app import SERVICE, make_app

    log = logging.getLogger("controller")
    host, port = listening
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    hup = asyncio.Event()
    # before anything slow: SIGHUP's default action would kill a starting controller
    loop.add_signal_handler(signal.SIGHUP, hup.set)
    app = make_app(config, options)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()  # opens the table and starts the loop
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        log.info("controller serving on %s", ", ".join(map(str, runner.addresses)))
        ha = app[SERVICE].ha
        if ha is not None:  # campaign once the advertised socket listens
            bound_host, bound_port = runner.addresses[0][:2]
            ha.start(f"http://{bound_host}:{bound_port}")
        follow = loop.create_task(sd.follow(lambda: _systemd_status(app)))
        reload_lock = asyncio.Lock()

        async def reloads() -> None:
            while True:
                await hup.wait()
                hup.clear()
                async with reload_lock:
                    await _reload(app, args, (host, port), sd)

        reloader = loop.create_task(reloads(), name="controller-reloads")
        watcher = loop.create_task(_watch_engines_state(args.config, hup), name="engines-state")
        await stop.wait()
        log.info("controller stopping")
        sd.stopping("controller stopping")
        follow.cancel()
        # let a running reload finish (it may be mid-solve), bounded like a period
        limit_s = app[SERVICE].config.controller.solve_time_limit_s + 5.0
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(reload_lock.acquire(), limit_s)
        reloader.cancel()
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reloader
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    finally:
        loop.remove_signal_handler(signal.SIGHUP)
        if app[SERVICE].ha is not None:
            await app[SERVICE].ha.stop()  # resign first: a follower leads without a TTL wait
        await runner.cleanup()


def _with_etcd(config: Config, urls: str) -> Config:
    """``config`` with ``controller.ha.etcd_urls`` set from a comma-separated list."""
    import msgspec

    listed = tuple(u.strip() for u in urls.split(",") if u.strip())
    if not listed:
        raise ValueError("no URL given")
    ha = msgspec.structs.replace(config.controller.ha, etcd_urls=listed)
    ha.__post_init__()  # structs.replace does not validate
    controller = msgspec.structs.replace(config.controller, ha=ha)
    return msgspec.structs.replace(config, controller=controller)


async def _watch_engines_state(config_path: str, hup: asyncio.Event) -> None:
    """Reload (as SIGHUP does) whenever the engines state file changes: the proxy's admin
    API and DNS discovery write it, and the controller plans over the same merged fleet."""
    import asyncio

    from fastroute.discovery.state_file import state_path_of, state_signature

    path = state_path_of(config_path)
    seen = state_signature(path)
    while True:
        await asyncio.sleep(ENGINES_STATE_POLL_S)
        now = state_signature(path)
        if now != seen:
            seen = now
            hup.set()


async def _reload(
    app: web.Application,
    args: argparse.Namespace,
    listening: tuple[str, int],
    sd: Notifier,
) -> None:
    """One SIGHUP: re-read ``args.config`` and switch the running service to it (or not)."""
    import logging

    import msgspec

    from controller.app import SERVICE
    from fastroute.config import ConfigError
    from fastroute.discovery.merge import load_effective_config

    log = logging.getLogger("controller")
    svc = app[SERVICE]
    result = "error"
    sd.reloading("reloading the config")
    log.info("SIGHUP: reloading %s", args.config)
    try:
        config = load_effective_config(args.config)
        host, port = listening
        restart: list[str] = []
        new_host = args.host if args.host is not None else config.controller.host
        new_port = args.port if args.port is not None else config.controller.port
        if (new_host, new_port) != (host, port):
            restart.append(f"listen address {host}:{port} -> {new_host}:{new_port}")
        # the listener stays where it is: keep the values it was opened with
        old_ctl = svc.config.controller
        config = msgspec.structs.replace(
            config,
            controller=msgspec.structs.replace(
                config.controller, host=old_ctl.host, port=old_ctl.port
            ),
        )
        outcome = await svc.reload(config)
        restart.extend(outcome.needs_restart)
        for what in restart:
            log.warning("config reload: %s needs a restart; keeping the old value", what)
        result = "ok" if outcome.changed else "unchanged"
        svc.last_reload_error = None  # the file in force is valid again
    except ConfigError as exc:
        svc.last_reload_error = str(exc)
        log.error("config reload failed, still running on the previous config: %s", exc)
    except Exception as exc:  # a reload must never take the controller down
        svc.last_reload_error = f"{type(exc).__name__}: {exc}"
        log.exception("config reload failed, still running on the previous config")
    svc.metrics.config_reloads.labels(result=result).inc()
    if result == "unchanged":
        log.info("config reload: no change")
    sd.ready(_systemd_status(app) or "starting")


def _systemd_status(app: web.Application) -> str | None:
    """The controller's systemd STATUS= line; None until the first control period ended."""
    from controller.app import SERVICE

    svc = app[SERVICE]
    reload_note = (
        "" if svc.last_reload_error is None
        else f"; config reload FAILED (running on the previous config): {svc.last_reload_error}"
    )  # fmt: skip
    if svc.last_error is not None:
        return (
            f"table generation {svc.generation}; last period failed: {svc.last_error}{reload_note}"
        )
    if svc.plan is None:
        return None
    return f"serving; table generation {svc.generation}{reload_note}"
