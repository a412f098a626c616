"""A tiny OpenAI-like chat server on 127.0.0.1 for the load-driver tests.

Behaviour per request is chosen by the last user message's text (``mode:...`` prefix
not needed: the server's ``mode`` attribute applies to every request):

* ``ok`` (default): ``tokens`` content tokens, ``gap_s`` apart, usage with
  ``cached_tokens``; JSON when ``stream`` is false;
* ``status``: answer ``status_code`` with an OpenAI error body whose code is ``error_code``;
* ``cut``: send two tokens, then drop the connection;
* ``sse_error``: send one token, then a ``data: {"error": ...}`` event;
* ``hang``: accept and never answer (until the client goes away).

It records every request body and headers, and the peak number of requests in flight.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web


class ChatServer:
    """Start with ``await server.start()``; ``server.url`` is its base URL."""

    def __init__(self, name: str = "fake-0", *, tokens: int = 3, gap_s: float = 0.0) -> None:
        self.name = name
        self.tokens = tokens
        self.gap_s = gap_s
        self.mode = "ok"
        self.status_code = 429
        self.error_code: str | int | None = 429
        self.hold: asyncio.Event | None = None  # requests wait on it before answering
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.in_flight = 0
        self.peak_in_flight = 0
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def __aenter__(self) -> ChatServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def reply_text(self, index: int) -> str:
        """The full reply the ``index``-th request received (when answered normally)."""
        return "".join(self._token(index, i) for i in range(self.tokens))

    def _token(self, index: int, n: int) -> str:
        return f"r{index}t{n} "

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        index = len(self.bodies)
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            return await self._answer(request, body, index)
        finally:
            self.in_flight -= 1

    async def _answer(
        self, request: web.Request, body: dict[str, Any], index: int
    ) -> web.StreamResponse:
        if self.hold is not None:
            await self.hold.wait()
        if self.mode == "hang":
            await asyncio.Event().wait()
        headers = {"x-fastroute-engine": self.name}
        if self.mode == "status":
            err = {"error": {"message": "busy", "type": "RateLimitError", "code": self.error_code}}
            return web.json_response(err, status=self.status_code, headers=headers)
        usage = {
            "prompt_tokens": 40,
            "completion_tokens": self.tokens,
            "prompt_tokens_details": {"cached_tokens": 16},
        }
        if not body.get("stream"):
            text = self.reply_text(index)
            doc = {"choices": [{"message": {"role": "assistant", "content": text}}], "usage": usage}
            return web.json_response(doc, headers=headers)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
        await resp.prepare(request)
        role = {"choices": [{"delta": {"role": "assistant", "content": ""}}]}
        await resp.write(b"data: " + json.dumps(role).encode() + b"\n\n")
        for i in range(self.tokens):
            if i and self.gap_s:
                await asyncio.sleep(self.gap_s)
            if self.mode == "cut" and i == 2:
                assert request.transport is not None
                request.transport.close()
                return resp
            if self.mode == "sse_error" and i == 1:
                err = {"error": {"message": "engine failed mid-stream", "type": "upstream_error"}}
                await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
                await resp.write(b"data: [DONE]\n\n")
                return resp
            chunk = {"choices": [{"delta": {"content": self._token(index, i)}}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(
                b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n"
            )
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
