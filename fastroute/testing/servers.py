"""aiohttp applications served on loopback for in-process tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web

__all__ = ["serve_app"]


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
