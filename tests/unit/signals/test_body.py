"""read_bounded: a body that arrives in pieces is read whole; one past the bound is seen."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from fastroute.signals.body import read_bounded


async def _serve_in_pieces(pieces: list[bytes]) -> tuple[web.AppRunner, str]:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        for piece in pieces:  # separate writes with pauses: several reads on the client
            await resp.write(piece)
            await asyncio.sleep(0.02)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}/"


@pytest.mark.parametrize(("limit", "expect"), [(10_000, "whole"), (1500, "over")])
def test_a_body_in_pieces_is_read_whole_or_seen_over_the_bound(limit: int, expect: str) -> None:
    pieces = [bytes([65 + i]) * 1000 for i in range(3)]

    async def main() -> bytes:
        runner, url = await _serve_in_pieces(pieces)
        try:
            async with aiohttp.ClientSession() as http, http.get(url) as resp:
                first = await resp.content.read(10_000)  # what the old code kept
                assert len(first) < 3000  # the first piece only: the bug this guards against
                return first + await read_bounded(resp.content, limit - len(first))
        finally:
            await runner.cleanup()

    body = asyncio.run(main())
    if expect == "whole":
        assert body == b"".join(pieces)
    else:
        assert len(body) == limit + 1 and b"".join(pieces).startswith(body)
