"""Servers on loopback for in-process tests: aiohttp applications, and the proxy."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from fastroute.proxy.http.server import LeanServer
    from fastroute.proxy.proxy_app import ProxyApp

__all__ = ["serve_app", "serve_proxy_app"]


@asynccontextmanager
async def serve_app(app: web.Application, *, shutdown_timeout_s: float = 1.0) -> AsyncIterator[str]:
    """Serve ``app`` on a free port of 127.0.0.1; yields its root URL, cleans up on exit."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=shutdown_timeout_s)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def serve_proxy_app(
    app: ProxyApp, *, keepalive_s: float = 75.0, drain_timeout_s: float = 1.0
) -> AsyncIterator[tuple[str, LeanServer]]:
    """Start ``app`` and serve it on a free port of 127.0.0.1 with the lean server.

    The same pair ``fastroute serve`` workers run. Yields (root URL, server); on exit
    the server drains (unless the caller already did) and the app stops.
    """
    from fastroute.proxy.http.server import LeanServer

    await app.start()
    try:
        server = LeanServer(app, keepalive_s=keepalive_s)
        port = await server.start("127.0.0.1", 0)
        try:
            yield f"http://127.0.0.1:{port}", server
        finally:
            if not server.draining:
                await server.drain(drain_timeout_s)
    finally:
        await app.stop()
