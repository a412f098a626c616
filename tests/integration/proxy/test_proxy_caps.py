"""``engines[].max_concurrency``: an engine at its cap is skipped, all at cap → wait, then 429.

The engines are real HTTP servers on loopback that hold each request until the test
releases it, so "in flight" is under the test's control.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from multidict import CIMultiDict
from proxy_harness import Harness, config_toml, serve_proxy

from fastroute.config import decode_config

pytestmark = pytest.mark.integration

_ANSWER = json.dumps(
    {"id": "x", "object": "chat.completion", "choices": [], "usage": {"completion_tokens": 1}}
).encode()


class HeldEngine:
    """Answers each request only once the test calls :meth:`release`."""

    def __init__(self) -> None:
        self.held: list[asyncio.Event] = []
        self.running = 0
        self.max_running = 0
        self.server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        for event in self.held:
            event.set()
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    def release(self) -> None:
        """Answer the oldest held request."""
        next(e for e in self.held if not e.is_set()).set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                event = asyncio.Event()
                self.held.append(event)
                self.running += 1
                self.max_running = max(self.max_running, self.running)
                await event.wait()
                self.running -= 1
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%b" % (len(_ANSWER), _ANSWER)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


def test_engine_at_cap_is_skipped_then_requests_wait_then_429(h: Harness) -> None:
    """Cap 1 on both engines: the second request of a session goes to the other engine;
    a third waits for a slot and is served when one frees; with both held past
    ``admission.max_wait_s`` a request gets 429 ``engines_at_capacity`` + Retry-After.
    No engine ever sees more than one request at a time."""

    async def main() -> None:
        engines = [HeldEngine(), HeldEngine()]
        for e in engines:
            await e.start()
        toml = config_toml([e.url for e in engines], extra="[admission]\nmax_wait_s = 0.5\n")
        toml = toml.replace("capacity_rps = 10.0\n", "capacity_rps = 10.0\nmax_concurrency = 1\n")
        config = decode_config(toml, source="t.toml")
        try:
            async with (
                serve_proxy(config) as (app, url, _),
                aiohttp.ClientSession() as s,
            ):
                caps = app.context.fleet.caps
                body = h.chat_body("hi")
                session = {"x-session-id": "one-session"}

                async def call() -> tuple[int, str, CIMultiDict[str]]:
                    async with s.post(
                        url + "/v1/chat/completions", json=body, headers=session
                    ) as r:
                        return r.status, r.headers.get("x-fastroute-engine", ""), r.headers.copy()

                first = asyncio.create_task(call())
                await h.wait_until(lambda: sum(e.running for e in engines) == 1)
                second = asyncio.create_task(call())
                await h.wait_until(lambda: all(e.running == 1 for e in engines))
                third = asyncio.create_task(call())
                await h.wait_until(lambda: caps._freed is not None)  # third is waiting
                holder = next(i for i, e in enumerate(engines) if e.held)
                engines[holder].release()  # the first request ends: the third gets its slot
                status, engine1, _ = await first
                assert status == 200
                await h.wait_until(lambda: engines[holder].running == 1)
                # Both engines held again: a fourth request waits 0.5 s, then 429.
                status, _, headers = await call()
                assert status == 429 and int(headers["Retry-After"]) >= 1
                for e in engines:
                    while any(not ev.is_set() for ev in e.held):
                        e.release()
                results = [await second, await third]
                assert [r[0] for r in results] == [200, 200]
                assert results[0][1] != engine1  # the session's engine was at its cap
                assert results[1][1] == engine1  # the freed one
                assert [e.max_running for e in engines] == [1, 1]
                rid = headers["x-request-id"]
                async with s.get(url + f"/admin/decisions/{rid}") as r:
                    record = await r.json()
                assert record["error"].startswith("every candidate engine is at its")
                assert {f["filter"] for f in record["filters"]} == {"at_cap"}
        finally:
            for e in engines:
                await e.close()

    h.run(main())
