"""HTTP-level abuse of the lean server (``fastroute.proxy.http.server``) on raw sockets.

One explicit case per attack class (request smuggling with conflicting framing, bad
chunked bodies, malformed request lines, header floods, invalid UTF-8, pipelining
abuse, deeply nested JSON) and a hypothesis-generated stream of mutated requests. The
expectation is the same for all: a clean 4xx for client-caused input, never a 5xx, and
for a framing the server cannot trust (smuggling) 400 **and the connection closed**, so
no second request can hide behind the first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proxy_harness import Harness, config_toml, run, serve_proxy

from fastroute.config import decode_config
from fastroute.proxy.http.server import MAX_HEADER_BYTES

pytestmark = pytest.mark.integration

_CHAT = json.dumps(
    {"model": "demo-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
).encode()
_READ_S = 5.0


def _exchange(port: int, payload: bytes) -> tuple[list[int], bool]:
    """Send ``payload`` and read until the server closes or goes quiet: (statuses, closed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=_READ_S) as sock:
        sock.sendall(payload)
        data = b""
        closed = False
        sock.settimeout(1.0)
        while True:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            except ConnectionResetError:
                closed = True
                break
            if not chunk:
                closed = True
                break
            data += chunk
    # A body need not end in CRLF, so a status line can follow it on the same "line".
    statuses = [int(code) for code in re.findall(rb"HTTP/1\.[01] (\d{3}) ", data)]
    return statuses, closed


async def _exchange_async(port: int, payload: bytes) -> tuple[list[int], bool]:
    return await asyncio.to_thread(_exchange, port, payload)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _head(*lines: str) -> bytes:
    return (
        "\r\n".join(["POST /v1/chat/completions HTTP/1.1", "Host: x", *lines]) + "\r\n\r\n"
    ).encode()


_SMUGGLED = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"

#: Conflicting or obfuscated framings: each must be answered 400 and the connection closed.
SMUGGLING = {
    "cl_te": _head(f"Content-Length: {len(_CHAT)}", "Transfer-Encoding: chunked")
    + b"0\r\n\r\n"
    + _SMUGGLED,
    "te_cl": _head("Transfer-Encoding: chunked", "Content-Length: 3") + b"0\r\n\r\n" + _SMUGGLED,
    "duplicate_cl": _head("Content-Length: 5", "Content-Length: 40") + b"hello" + _SMUGGLED,
    "cl_list": _head("Content-Length: 5, 40") + b"hello" + _SMUGGLED,
    "cl_sign": _head("Content-Length: +5") + b"hello" + _SMUGGLED,
    "te_te_obfuscated": _head("Transfer-Encoding: chunked", "Transfer-Encoding: x")
    + b"0\r\n\r\n"
    + _SMUGGLED,
    "te_not_last": _head("Transfer-Encoding: chunked, identity") + b"0\r\n\r\n" + _SMUGGLED,
    "te_space_before_colon": _head("Transfer-Encoding : chunked") + b"0\r\n\r\n" + _SMUGGLED,
    "te_line_folding": _head("Transfer-Encoding:", " chunked") + b"0\r\n\r\n" + _SMUGGLED,
    "te_unknown": _head("Transfer-Encoding: xchunked") + b"0\r\n\r\n" + _SMUGGLED,
    "chunk_size_not_hex": _head("Transfer-Encoding: chunked") + b"zz\r\nhello\r\n0\r\n\r\n",
    "chunk_size_overflow": _head("Transfer-Encoding: chunked")
    + b"ffffffffffffffffffff\r\nhello\r\n0\r\n\r\n",
    "chunk_missing_crlf": _head("Transfer-Encoding: chunked")
    + b"5\r\nhelloXX0\r\n\r\n"
    + _SMUGGLED,
    "chunk_bare_lf": _head("Transfer-Encoding: chunked") + b"5\nhello\n0\n\n" + _SMUGGLED,
    "chunk_extension_garbage": _head("Transfer-Encoding: chunked")
    + b"5;\x00\r\nhello\r\n0\r\n\r\n",
}

#: Malformed heads: a 4xx (400 or 431), never a 5xx.
MALFORMED = {
    "bad_version": b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n",
    "garbage_line": b"\x00\x01\x02 \xff\xfe\r\n\r\n",
    "bad_method": b"G(T /health HTTP/1.1\r\nHost: x\r\n\r\n",
    "space_in_path": b"GET /he alth HTTP/1.1\r\nHost: x\r\n\r\n",
    "header_without_colon": b"GET /health HTTP/1.1\r\nHost x\r\n\r\n",
    "nul_in_header": b"GET /health HTTP/1.1\r\nHost: x\x00y\r\n\r\n",
    "header_count_flood": b"GET /health HTTP/1.1\r\n"
    + b"".join(b"X-%d: v\r\n" % i for i in range(20000))
    + b"\r\n",
    "header_size_flood": b"GET /health HTTP/1.1\r\nX-Big: "
    + b"a" * (MAX_HEADER_BYTES + 10)
    + b"\r\n\r\n",
    "url_flood": b"GET /" + b"a" * (MAX_HEADER_BYTES + 10) + b" HTTP/1.1\r\n\r\n",
}


def test_smuggling_attempts_get_400_and_the_connection_closed(h: Harness) -> None:
    """Every conflicting framing is refused with 400 and the connection closed: the
    smuggled ``GET /health`` behind it is never answered."""

    async def main() -> None:
        async with h.proxy_stack(1) as stack:
            port = _port(stack.url)
            for name, payload in SMUGGLING.items():
                statuses, closed = await _exchange_async(port, payload)
                assert statuses == [400] and closed, (name, statuses, closed)

    run(main(), timeout=120)


def test_malformed_heads_and_floods_get_a_4xx(h: Harness) -> None:
    async def main() -> None:
        async with h.proxy_stack(1) as stack:
            port = _port(stack.url)
            failed = {}
            for name, payload in MALFORMED.items():
                statuses, closed = await _exchange_async(port, payload)
                if not (len(statuses) == 1 and 400 <= statuses[0] < 500 and closed):
                    failed[name] = (statuses, closed)
            assert not failed

    run(main(), timeout=120)


def test_invalid_utf8_in_path_and_headers_is_not_a_5xx(h: Harness) -> None:
    """Bytes that are not UTF-8 in the path or a header value: 4xx (404 for an unknown
    path), never a 5xx; the server keeps serving."""

    async def main() -> None:
        async with h.proxy_stack(1) as stack:
            port = _port(stack.url)
            payloads = [
                b"GET /\xff\xfe HTTP/1.1\r\nHost: x\r\n\r\n",
                b"GET /health HTTP/1.1\r\nHost: x\r\nX-Tenant: \xff\xfe\xc0\r\n\r\n",
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\r\n"
                b"Content-Length: %d\r\n\r\n%b" % (len(_CHAT), _CHAT),
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\n"
                b'"\xff"x',
            ]
            for payload in payloads:
                statuses, _ = await _exchange_async(port, payload)
                assert statuses and all(s < 500 for s in statuses), (payload[:60], statuses)
            statuses, _ = await _exchange_async(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert statuses == [200]

    run(main(), timeout=60)


def test_deeply_nested_json_is_a_400_on_every_json_endpoint(h: Harness) -> None:
    """Regression: an unknown field holding 100,000 nested arrays was a 500 (the
    decoder's ``RecursionError``); every JSON body decoder on the request path says 400."""
    nested = b"[" * 100_000 + b"]" * 100_000
    messages = b'"messages":[{"role":"user","content":"hi"}]'
    bodies = {
        "/v1/chat/completions": b'{"model":"demo-8b",%b,"x":%%b}' % messages,
        "/v1/completions": b'{"model":"demo-8b","prompt":"hi","x":%b}',
        "/v1/responses": b'{"model":"demo-8b","input":"hi","x":%b}',
        "/v1/messages": b'{"model":"demo-8b","max_tokens":2,%b,"x":%%b}' % messages,
        "/v1/embeddings": b'{"model":"demo-8b","input":"hi","x":%b}',
        "/v1/chat/completions?deep": b"%b",
    }

    async def main() -> None:
        async with h.proxy_stack(1, extra="[limits]\nmax_body_bytes = 1048576\n") as stack:
            port = _port(stack.url)
            for path, template in bodies.items():
                body = template % nested
                payload = (
                    f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n"
                ).encode() + body
                statuses, _ = await _exchange_async(port, payload)
                assert statuses and statuses[0] in (400, 404), (path, statuses)

    run(main(), timeout=60)


def test_pipelining_flood_is_bounded_and_answered_in_order(h: Harness) -> None:
    """200 pipelined requests in one write: reading pauses at the pipeline bound, every
    request is still answered, in order, and nothing is a 5xx."""

    async def main() -> None:
        async with h.proxy_stack(1) as stack:
            port = _port(stack.url)
            payload = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * 199
            payload += b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            statuses, closed = await _exchange_async(port, payload)
            assert statuses == [200] * 200 and closed

    run(main(), timeout=60)


_TOKENS = (
    b"GET|POST| |/health|/v1/chat/completions|HTTP/1.1|HTTP/1.0|\r\n|\n|:|Host: x|"
    b"Content-Length: |Transfer-Encoding: chunked|0|5|-1|ffffffff|hello|\x00|\xff|;ext=1|"
    b'Connection: close|Expect: 100-continue|{|}|[|"|\t'
).split(b"|")


@pytest.fixture(scope="module")
def background_port() -> Iterator[int]:
    """One proxy stack for every generated example, on its own loop in a thread (a stack
    per example would spend the budget starting engines)."""
    started: dict[str, object] = {}
    ready = threading.Event()

    async def serve() -> None:
        stop = asyncio.Event()
        started["stop"] = (asyncio.get_running_loop(), stop)
        async with Harness().proxy_stack(1) as stack:
            started["port"] = _port(stack.url)
            ready.set()
            await stop.wait()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(30), "proxy stack did not start"
    yield started["port"]  # type: ignore[misc]
    loop, stop = started["stop"]  # type: ignore[misc]
    loop.call_soon_threadsafe(stop.set)
    thread.join(10)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(st.sampled_from(_TOKENS) | st.binary(max_size=8), max_size=40))
def test_generated_requests_never_get_a_5xx(background_port: int, parts: list[bytes]) -> None:
    """Requests assembled from HTTP fragments and random bytes: no response is a 5xx
    and the server stays up (a health check after each)."""
    statuses, _ = _exchange(background_port, b"".join(parts) + b"\r\n\r\n")
    assert all(s < 500 for s in statuses), statuses
    health = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    assert _exchange(background_port, health)[0] == [200]


async def _trickle_until_closed(port: int, limit_s: float) -> float | None:
    """Send a head one byte every 0.1 s, never finishing it: seconds until the server
    closed the connection (None if it did not within ``limit_s``)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    loop = asyncio.get_running_loop()
    start = loop.time()
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    try:
        while loop.time() - start < limit_s:
            with contextlib.suppress(asyncio.TimeoutError):
                if await asyncio.wait_for(reader.read(1), 0.1) == b"":
                    return loop.time() - start
            writer.write(b"a")
            await writer.drain()
    except ConnectionError:
        return loop.time() - start
    finally:
        writer.close()
    return None


def test_slowloris_head_is_cut_off_by_header_timeout(h: Harness) -> None:
    """A client trickling a request head, never finishing it, is closed once
    ``limits.header_timeout_s`` has passed (checked every half of it), although bytes
    keep arriving and the keep-alive bound (75 s) is far away."""

    async def main() -> None:
        extra = "[limits]\nheader_timeout_s = 0.5\n"
        config = decode_config(config_toml(["http://127.0.0.1:9"], extra), source="t.toml")
        async with serve_proxy(config) as (_, url, server):
            closed_after_s = await _trickle_until_closed(_port(url), limit_s=10.0)
            assert closed_after_s is not None and 0.4 < closed_after_s < 2.0, closed_after_s
            await h.wait_until(lambda: not server.connections)
            # A head sent whole is not affected.
            statuses, _ = await _exchange_async(_port(url), b"GET /health HTTP/1.1\r\n\r\n")
            assert statuses == [200]

    h.run(main())


def test_an_idle_keep_alive_connection_outlives_the_header_timeout(h: Harness) -> None:
    """A request that arrives whole in one read, head and body, leaves no head pending:
    the connection then idles under the keep-alive bound (75 s), not the header timeout.
    (The head's byte count once went on counting the bytes of the request just parsed,
    with the first request's arrival as the head's start, so the sweep closed idle
    keep-alive connections as slowloris: a client reusing one saw it disconnected.)"""

    async def main() -> None:
        extra = "[limits]\nheader_timeout_s = 0.5\n"
        config = decode_config(config_toml(["http://127.0.0.1:9"], extra), source="t.toml")
        async with serve_proxy(config) as (_, url, _server):
            reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
            try:
                for _ in range(3):
                    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_S)
                    assert head.startswith(b"HTTP/1.1 200 ") and b"close" not in head.lower()
                    length = re.search(rb"(?i)content-length: (\d+)", head)
                    assert length is not None
                    await asyncio.wait_for(reader.readexactly(int(length.group(1))), _READ_S)
                    try:  # four sweeps of the header timeout: still open, nothing sent
                        data = await asyncio.wait_for(reader.read(1), 2.0)
                    except TimeoutError:
                        continue
                    raise AssertionError(f"the idle connection was closed (read {data!r})")
            finally:
                writer.close()

    h.run(main())


def test_client_that_never_reads_is_paused_then_dropped(h: Harness) -> None:
    """A client that sends a streamed request and never reads: the proxy pauses (its
    write buffer stays bounded) and, once its buffer stayed full for
    ``limits.write_stall_timeout_s``, drops the connection (and the engine stream)
    instead of holding both forever."""
    from test_proxy_server import _post, _sse_engine

    async def main() -> None:
        sent = [0]
        writers: list[asyncio.StreamWriter] = []
        engine, engine_url = await _sse_engine(64 * 1024 * 1024, sent, writers)
        extra = "[limits]\nwrite_stall_timeout_s = 1.0\n"
        config = decode_config(config_toml([engine_url], extra), source="t.toml")
        try:
            async with serve_proxy(config) as (_, url, server):
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
                sock.connect(("127.0.0.1", _port(url)))
                sock.setblocking(False)
                _, writer = await asyncio.open_connection(sock=sock)
                writer.write(_post(json.dumps(json.loads(_CHAT) | {"stream": True}).encode()))
                await h.wait_until(lambda: any(c.write_paused for c in server.connections), 10.0)
                conn = next(c for c in server.connections if c.write_paused)
                assert conn.transport.get_write_buffer_size() <= 1024 * 1024
                start = asyncio.get_running_loop().time()
                await h.wait_until(lambda: conn.lost, timeout=20.0)
                assert asyncio.get_running_loop().time() - start < 5.0
                assert sent[0] < 64 * 1024 * 1024 // 2
                # the engine's stream was closed too
                await h.wait_until(lambda: writers[0].is_closing(), timeout=10.0)
                writer.close()
        finally:
            engine.close()
            await engine.wait_closed()

    h.run(main(), timeout=60.0)
