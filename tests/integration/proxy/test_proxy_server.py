"""The lean HTTP/1.1 front end (``fastroute.proxy.http.server``) on raw sockets.

Pipelining, ``Expect: 100-continue``, malformed requests, header and body limits,
HTTP/1.0, idle keep-alive, back-pressure to a client that does not read; and errors,
JSON, streams and admin routes answered through it end to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator

import aiohttp
import pytest
from proxy_harness import Harness, config_toml, serve_proxy

from fastroute.config import decode_config
from fastroute.proxy.http.server import MAX_HEADER_BYTES

pytestmark = pytest.mark.integration

_CHAT = json.dumps(
    {"model": "demo-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
).encode()


def _post(body: bytes, *extra: str, path: str = "/v1/chat/completions") -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: x", "Content-Type: application/json", *extra]
    if not any(h.lower().startswith(("content-length", "transfer-encoding")) for h in extra):
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One response (Content-Length or chunked framing): status, headers, body."""
    status_line = await reader.readline()
    assert status_line.startswith(b"HTTP/1."), status_line
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    parts: list[bytes] = []  # joined once: a 20 MB body comes in ~20k chunks
    while True:
        size = int((await reader.readline()).strip(), 16)
        chunk = await reader.readexactly(size + 2)
        if size == 0:
            return status, headers, b"".join(parts)
        parts.append(chunk[:-2])


@contextlib.asynccontextmanager
async def _open(url: str) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def test_pipelined_requests_are_answered_in_order(h: Harness) -> None:
    """Three requests in one write: three answers, in request order, on one connection."""

    async def main() -> None:
        async with h.proxy_stack(1) as st, _open(st.url) as (reader, writer):
            writer.write(
                b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
                + _post(_CHAT)
                + b"GET /no/such HTTP/1.1\r\nHost: x\r\n\r\n"
            )
            statuses = []
            for _ in range(3):
                status, headers, body = await _read_response(reader)
                statuses.append(status)
                assert headers["x-request-id"].startswith("req-")
            assert statuses == [200, 200, 404]
            assert json.loads(body)["error"]["code"] == "unknown_url"

    h.run(main())


def test_expect_continue_and_body_limit(h: Harness) -> None:
    """``Expect: 100-continue`` gets ``100 Continue`` then the answer; a declared length
    over the limit gets 413 without ``100 Continue``; a chunked body over the limit gets
    413 and the connection stays usable."""

    async def main() -> None:
        async with h.proxy_stack(1, extra="[limits]\nmax_body_bytes = 4096\n") as st:
            async with _open(st.url) as (reader, writer):
                writer.write(_post(b"", "Expect: 100-continue", f"Content-Length: {len(_CHAT)}"))
                assert await reader.readline() == b"HTTP/1.1 100 Continue\r\n"
                assert await reader.readline() == b"\r\n"
                writer.write(_CHAT)
                status, _, _ = await _read_response(reader)
                assert status == 200
                writer.write(_post(b"", "Expect: 100-continue", "Content-Length: 100000"))
                status, _, body = await _read_response(reader)
                assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
            async with _open(st.url) as (reader, writer):
                chunk = b"x" * 3000
                chunked = (b"%x\r\n%b\r\n" % (len(chunk), chunk)) * 3 + b"0\r\n\r\n"
                writer.write(_post(chunked, "Transfer-Encoding: chunked"))
                status, _, _ = await _read_response(reader)
                assert status == 413
                writer.write(_post(_CHAT))  # same connection, next request
                status, _, _ = await _read_response(reader)
                assert status == 200
            record = st.ctx.decisions
            assert len(record) >= 1

    h.run(main())


def test_malformed_request_and_oversized_headers_close_the_connection(h: Harness) -> None:
    """Garbage → 400 OpenAI error, then close; headers over the limit → 431, then close."""

    async def main() -> None:
        async with h.proxy_stack(1) as st:
            async with _open(st.url) as (reader, writer):
                writer.write(b"NOT AN HTTP REQUEST\r\n\r\n")
                status, headers, body = await _read_response(reader)
                assert status == 400 and headers["connection"] == "close"
                assert json.loads(body)["error"]["code"] == "bad_request"
                assert await reader.read() == b""  # closed by the proxy
            async with _open(st.url) as (reader, writer):
                big = "a" * 1000
                lines = [f"X-Filler-{i}: {big}" for i in range(MAX_HEADER_BYTES // 1000 + 8)]
                writer.write(("GET /health HTTP/1.1\r\nHost: x\r\n" + "\r\n".join(lines)).encode())
                status, _, body = await _read_response(reader)
                assert status == 431 and json.loads(body)["error"]["code"] == "headers_too_large"
                assert await reader.read() == b""

    h.run(main())


def test_http10_and_idle_keepalive_close(h: Harness) -> None:
    """HTTP/1.0 gets ``Connection: close`` and a closed connection; an idle keep-alive
    connection is closed after ``keepalive_s``."""

    async def main() -> None:
        config = decode_config(config_toml(["http://127.0.0.1:9"]), source="t.toml")
        async with serve_proxy(config, keepalive_s=0.3) as (_, url, server):
            async with _open(url) as (reader, writer):
                writer.write(b"GET /health HTTP/1.0\r\n\r\n")
                status, headers, _ = await _read_response(reader)
                assert status == 200 and headers["connection"] == "close"
                assert await reader.read() == b""
            async with _open(url) as (reader, writer):
                writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                status, headers, _ = await _read_response(reader)
                assert status == 200 and "connection" not in headers
                # Idle from now on: the sweeper closes it (bounded by the run timeout).
                assert await asyncio.wait_for(reader.read(), 10.0) == b""
            await h.wait_until(lambda: not server.connections)

    h.run(main())


async def _sse_engine(
    total_bytes: int, sent: list[int], writers: list[asyncio.StreamWriter]
) -> tuple[asyncio.Server, str]:
    """A real engine on loopback that streams ``total_bytes`` of SSE as fast as it can."""
    event = b"data: " + json.dumps({"choices": [{"delta": {"content": "x" * 900}}]}).encode()
    event += b"\n\n"

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"POST "):  # the proxy's GET /v1/models: no model list here
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            writer.close()
            return
        writers.append(writer)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        while sent[0] < total_bytes:
            writer.write(b"%x\r\n%b\r\n" % (len(event), event))
            sent[0] += len(event)
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


def test_slow_client_gets_back_pressure_not_buffering(h: Harness) -> None:
    """A client that stops reading pauses the relay: the proxy's buffers stay bounded
    while the engine has far more to send; once the client reads, it gets every byte."""
    total = 24 * 1024 * 1024

    async def main() -> None:
        sent = [0]
        writers: list[asyncio.StreamWriter] = []
        engine, engine_url = await _sse_engine(total, sent, writers)
        config = decode_config(config_toml([engine_url]), source="t.toml")
        try:
            async with serve_proxy(config) as (_, url, server):
                host, port = url.removeprefix("http://").split(":")
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
                sock.connect((host, int(port)))
                sock.setblocking(False)
                reader, writer = await asyncio.open_connection(sock=sock)
                body = json.loads(_CHAT) | {"stream": True}
                writer.write(_post(json.dumps(body).encode()))
                await h.wait_until(
                    lambda: any(c.write_paused for c in server.connections), timeout=10.0
                )
                conn = next(c for c in server.connections if c.write_paused)
                # The engine is held back too: the kernel stops taking its bytes (the
                # proxy stopped reading them), far below the stream's size.
                await h.wait_until(
                    lambda: bool(writers) and writers[0].transport.get_write_buffer_size() > 0,
                    timeout=10.0,
                )
                assert conn.write_paused  # the client still reads nothing
                assert conn.transport.get_write_buffer_size() <= 1024 * 1024
                assert sent[0] < total // 2
                status, headers, data = await _read_response(reader)
                assert status == 200 and headers["content-type"] == "text/event-stream"
                assert len(data) == sent[0] >= total  # every byte, in order
                assert data.endswith(b"\n\n") and data.count(b"data: ") == data.count(b"\n\n")
                writer.close()
        finally:
            engine.close()
            await engine.wait_closed()

    h.run(main(), timeout=60.0)


def test_errors_json_stream_and_admin_routes(h: Harness) -> None:
    """Errors, a JSON answer, a stream and the admin routes, through the lean server."""

    async def main() -> None:
        async with (
            h.proxy_stack(1, extra="[limits]\nmax_body_bytes = 2048\n") as st,
            aiohttp.ClientSession() as s,
        ):
            async with s.post(st.url + "/v1/chat/completions", json=h.chat_body("hi")) as r:
                assert r.status == 200 and r.headers["x-fastroute-engine"] == "engine-0"
                rid = r.headers["x-request-id"]
                assert r.headers["x-fastroute-worker"].isdigit()
                assert (await r.json())["object"] == "chat.completion"
            body = h.chat_body("hi", stream=True)
            async with s.post(st.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200 and r.headers["x-request-id"].startswith("req-")
                events, done = await h.read_sse(r)
                assert events and done
            async with s.post(st.url + "/v1/completions", data=b"x" * 4096) as r:
                assert r.status == 413
            async with s.get(st.url + "/v1/chat/completions") as r:
                assert r.status == 405 and (await r.json())["error"]["code"] == "method_not_allowed"
            async with s.get(st.url + f"/admin/decisions/{rid}") as r:
                assert r.status == 200 and (await r.json())["request_id"] == rid
            async with s.get(st.url + "/v1/models") as r:
                assert [m["id"] for m in (await r.json())["data"]] == [h.MODEL]
            async with s.get(st.url + "/metrics") as r:
                text = await r.text()
            assert 'engine="engine-0",status="200"} 2.0' in text

    h.run(main())
