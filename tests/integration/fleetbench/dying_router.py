"""A "router" for the harness tests: forwards chat requests to one engine, exits after a while.

``python dying_router.py --port P --engine URL --exit-after-s S`` serves on 127.0.0.1:P
by relaying the raw response of ``URL`` (so it passes the readiness check), then exits
with status 3 ``S`` seconds after its first request: a router that dies mid-run.
"""

from __future__ import annotations

import argparse
import asyncio
import os

import aiohttp
from aiohttp import web


async def main(port: int, engine: str, exit_after_s: float) -> None:
    http = aiohttp.ClientSession()
    timer: list[asyncio.TimerHandle] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        if not timer:
            loop = asyncio.get_running_loop()
            timer.append(loop.call_later(exit_after_s, os._exit, 3))
        body = await request.read()
        headers = {"Content-Type": "application/json"}
        async with http.post(
            engine.split(",")[0] + "/v1/chat/completions", data=body, headers=headers
        ) as up:
            resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.content_type})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--engine", required=True)
    parser.add_argument("--exit-after-s", type=float, required=True)
    args = parser.parse_args()
    asyncio.run(main(args.port, args.engine, args.exit_after_s))
