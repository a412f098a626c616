"""The lean HTTP/1.1 upstream client against tiny raw-asyncio servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from types import SimpleNamespace
from typing import Any

import pytest
import uvloop

from fastroute.config import EngineConfig
from fastroute.guards.outlier import Outcome
from fastroute.proxy.http import http1, upstream
from fastroute.proxy.http.upstream import UpstreamError, UpstreamPool

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


def run(coro: Coroutine[Any, Any, Any], timeout: float = 20.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


class Server:
    """Accepted connections, requests seen, and the most connections open at once."""

    def __init__(self) -> None:
        self.accepted = 0
        self.open = 0
        self.max_open = 0
        self.requests: list[bytes] = []
        self.port = 0


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    """One request (head + Content-Length body), or None at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)


def ok(body: bytes, extra: str = "") -> bytes:
    head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n{extra}"
    return f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)


@contextlib.asynccontextmanager
async def serve(handler: Handler) -> AsyncIterator[Server]:
    state = Server()

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state.accepted += 1
        state.open += 1
        state.max_open = max(state.max_open, state.open)
        try:
            await handler(reader, writer, state.accepted)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            state.open -= 1
            writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    state.port = server.sockets[0].getsockname()[1]
    try:
        yield state
    finally:
        server.close()


def keepalive_handler(state_body: bytes = b'{"ok":true}', delay: float = 0.0) -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while await read_request(reader) is not None:
            if delay:
                await asyncio.sleep(delay)
            writer.write(ok(state_body))
            await writer.drain()

    return handle


def pool(server: Server, limit: int = 8, keepalive_s: float = 30.0) -> http1.HostPool:
    return http1.HostPool("127.0.0.1", server.port, limit=limit, keepalive_s=keepalive_s)


async def fetch(p: http1.HostPool, body: bytes = b"{}", wait_s: float = 2.0) -> bytes:
    loop = asyncio.get_running_loop()
    resp = await p.request(
        "/v1/x", body, [("X-A", "1")], deadline=loop.time() + wait_s, connect_timeout_s=1.0
    )
    try:
        parts = []
        while chunk := await resp.read(wait_s, loop.time() + wait_s):
            parts.append(chunk)
        return b"".join(parts)
    finally:
        resp.close()


@pytest.mark.parametrize("use_uvloop", [False, True])
def test_content_length_body_and_keepalive_reuse(use_uvloop: bool) -> None:
    """Content length body and keepalive reuse."""
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while (req := await read_request(reader)) is not None:
            seen.append(req)
            writer.write(ok(b'{"n":%d}' % len(seen), "X-Engine: e\r\n"))

    async def main() -> None:
        async with serve(handle) as srv:
            p = pool(srv)
            loop = asyncio.get_running_loop()
            resp = await p.request(
                "/v1/chat/completions",
                b'{"a":1}',
                [("X-A", "1"), ("Host", "evil"), ("Content-Length", "99")],
                deadline=loop.time() + 2,
                connect_timeout_s=1.0,
            )
            assert resp.status == 200
            assert resp.content_type == "application/json"
            assert resp.headers["x-engine"] == "e"
            assert await resp.read(1.0, loop.time() + 1) == b'{"n":1}'
            assert await resp.read(1.0, loop.time() + 1) == b""
            resp.close()
            for i in range(2, 5):
                assert await fetch(p) == b'{"n":%d}' % i
            assert srv.accepted == 1 and p.opened == 1 and p.idle == 1
            p.close()
        head = seen[0].split(b"\r\n")
        assert head[0] == b"POST /v1/chat/completions HTTP/1.1"
        assert f"Host: 127.0.0.1:{srv.port}".encode() in head
        assert b"Connection: keep-alive" in head and b"Content-Length: 7" in head
        assert b"X-A: 1" in head and b"Host: evil" not in head
        assert seen[0].endswith(b'\r\n\r\n{"a":1}')

    if use_uvloop:
        uvloop.run(asyncio.wait_for(main(), 20))
    else:
        run(main())


def test_chunked_body() -> None:
    """Chunked body."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while await read_request(reader) is not None:
            writer.write(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                + chunked(b"hello ", b"chunked ", b"world")
                + b"0\r\n\r\n"
            )

    async def main() -> None:
        async with serve(handle) as srv:
            p = pool(srv)
            assert await fetch(p) == b"hello chunked world"
            assert await fetch(p) == b"hello chunked world"
            assert srv.accepted == 1
            p.close()

    run(main())


def test_sse_streamed_in_pieces() -> None:
    """Sse streamed in pieces."""
    events = [b'data: {"i":%d}\n\n' % i for i in range(5)] + [b"data: [DONE]\n\n"]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD)
        for ev in events:
            await asyncio.sleep(0.03)
            writer.write(chunked(ev))
        writer.write(b"0\r\n\r\n")
        await read_request(reader)

    async def main() -> None:
        async with serve(handle) as srv:
            p = pool(srv)
            loop = asyncio.get_running_loop()
            resp = await p.request("/s", b"{}", [], deadline=loop.time() + 2, connect_timeout_s=1)
            assert resp.content_type == "text/event-stream"
            got = []
            while chunk := await resp.read(1.0, loop.time() + 5):
                got.append(chunk)
            assert got == events  # each arrived on its own: delivered as it came
            resp.close()
            assert p.idle == 1
            p.close()

    run(main())


def test_idle_pooled_connection_closed_by_server() -> None:
    """Idle pooled connection closed by server."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(ok(b"x"))
        await writer.drain()  # then close: the server's keep-alive timeout

    async def main() -> None:
        async with serve(handle) as srv:
            p = pool(srv)
            assert await fetch(p) == b"x"
            await asyncio.sleep(0.1)  # the FIN arrives; the pool forgets the connection
            assert p.idle == 0 and p.size == 0
            assert await fetch(p) == b"x"
            assert srv.accepted == 2
            p.close()

    run(main())


def test_stale_reused_connection_is_retried_once() -> None:
    """Stale reused connection is retried once."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(ok(b"conn %d" % n))
        await writer.drain()
        if n == 1:
            # Keep-alive race: the next request arrives as the server gives up on the
            # connection, which closes without a response byte.
            await read_request(reader)
            return
        while await read_request(reader) is not None:
            writer.write(ok(b"conn %d" % n))

    async def main() -> None:
        async with serve(handle) as srv:
            p = pool(srv)
            assert await fetch(p) == b"conn 1"
            assert await fetch(p) == b"conn 2"  # retried on a fresh connection
            assert srv.accepted == 2
            p.close()

    run(main())


def test_fresh_connection_closed_before_responding_is_not_retried() -> None:
    """Fresh connection closed before responding is not retried."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)

    async def main() -> None:
        async with serve(handle) as srv:
            p = pool(srv)
            with pytest.raises(http1.ConnectionDropped):
                await fetch(p)
            assert srv.accepted == 1
            p.close()

    run(main())


def _refused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _upstream(**timeouts: float) -> UpstreamPool:
    t = {"connect_timeout_s": 1.0, "first_byte_timeout_s": 2.0, "idle_timeout_s": 2.0}
    config: Any = SimpleNamespace(
        timeouts=SimpleNamespace(**{**t, "total_timeout_s": 10.0, **timeouts}),
        limits=SimpleNamespace(max_concurrent_requests=8),
    )
    return UpstreamPool(config)


def _engine(port: int) -> EngineConfig:
    return EngineConfig(name="engine-a", url=f"http://127.0.0.1:{port}", models=("m",))


def test_connect_refused() -> None:
    """Connect refused."""

    async def main() -> None:
        up = _upstream()
        port = _refused_port()
        loop = asyncio.get_running_loop()
        with pytest.raises(UpstreamError) as err:
            await up.open(_engine(port), "/v1/x", b"{}", {}, loop.time() + 5)
        assert err.value.outcome is Outcome.CONNECT_ERROR and err.value.status == 502
        assert err.value.message == "cannot connect to engine engine-a"
        await up.close()

    run(main())


def test_first_byte_timeout() -> None:
    """A server that never answers fails the attempt with TIMEOUT after first_byte_timeout_s."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await asyncio.sleep(5)

    async def main() -> None:
        async with serve(handle) as srv:
            up = _upstream(first_byte_timeout_s=0.2)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(UpstreamError) as err:
                await up.open(_engine(srv.port), "/v1/x", b"{}", {}, loop.time() + 5)
            assert 0.15 < loop.time() - t0 < 2.5  # the server would answer only after 5 s
            assert err.value.outcome is Outcome.TIMEOUT and err.value.status == 504
            assert "engine-a" in err.value.message and "127.0.0.1" not in err.value.message
            await up.close()

    run(main())


def test_total_deadline_caps_first_byte_wait() -> None:
    """The attempt's total deadline cuts a longer first-byte timeout short."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await asyncio.sleep(5)

    async def main() -> None:
        async with serve(handle) as srv:
            up = _upstream(first_byte_timeout_s=3.0)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(UpstreamError):
                await up.open(_engine(srv.port), "/v1/x", b"{}", {}, loop.time() + 0.2)
            assert loop.time() - t0 < 2.5  # the first-byte timeout alone would be 3 s
            await up.close()

    run(main())


@pytest.mark.parametrize("relay", [False, True], ids=["read", "relay"])
def test_idle_timeout_mid_body(relay: bool) -> None:
    """A stream that stalls mid-body fails with TIMEOUT after idle_timeout_s, whether
    read chunk by chunk or relayed from the connection's callback."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD + chunked(b"data: 1\n\n"))
        await asyncio.sleep(5)

    async def main() -> None:
        async with serve(handle) as srv:
            up = _upstream(idle_timeout_s=0.2)
            loop = asyncio.get_running_loop()
            resp = await up.open(_engine(srv.port), "/v1/x", b"{}", {}, loop.time() + 5)
            got: list[bytes] = []
            if relay:
                resp.relay(lambda data, now, last: got.append(data) is None)
            else:
                got.append(await up.read_chunk(resp, "engine-a", 1.0, loop.time() + 5))
            t0 = loop.time()
            with pytest.raises(UpstreamError) as err:
                if relay:
                    await up.wait_end(resp, "engine-a", loop.time() + 5)
                else:
                    await up.read_chunk(resp, "engine-a", 0.2, loop.time() + 5)
            assert 0.1 < loop.time() - t0 < 2.5  # the server would answer only after 5 s
            assert err.value.outcome is Outcome.TIMEOUT
            assert err.value.message == "engine engine-a timed out mid-response"
            assert got == [b"data: 1\n\n"]
            resp.close()
            await up.close()

    run(main())


def test_lazy_timer_is_rearmed_not_fired_early() -> None:
    """Chunks every 50 ms with a 0.3 s idle timeout: one long stream never times out."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD)
        for _ in range(15):
            writer.write(chunked(b"data: x\n\n"))
            await asyncio.sleep(0.05)
        writer.write(b"0\r\n\r\n")

    async def main() -> None:
        async with serve(handle) as srv:
            up = _upstream()
            loop = asyncio.get_running_loop()
            resp = await up.open(_engine(srv.port), "/v1/x", b"{}", {}, loop.time() + 5)
            n = 0
            while await up.read_chunk(resp, "engine-a", 0.3, loop.time() + 5):
                n += 1
            assert n == 15
            resp.close()
            await up.close()

    run(main())


def test_relay_hands_on_each_read_and_ends() -> None:
    """Relay mode: each paced event reaches the consumer from the connection's callback
    (no read() call), with its arrival time, and the read that also ends the body is
    marked last; wait_end returns at the end and the connection is pooled again."""
    events = [b"data: %d\n\n" % i for i in range(5)]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD)
        for ev in events[:-1]:
            writer.write(chunked(ev))
            await writer.drain()
            await asyncio.sleep(0.03)
        writer.write(chunked(events[-1]) + b"0\r\n\r\n")  # the last event and the end
        await read_request(reader)

    async def main() -> None:
        async with serve(handle) as srv:
            up = _upstream()
            loop = asyncio.get_running_loop()
            resp = await up.open(_engine(srv.port), "/v1/x", b"{}", {}, loop.time() + 5)
            got: list[tuple[bytes, float, bool]] = []
            resp.relay(lambda data, now, last: got.append((data, now, last)) is None)
            await up.wait_end(resp, "engine-a", loop.time() + 5)
            assert b"".join(d for d, _, _ in got) == b"".join(events)
            assert len(got) >= 3  # paced 30 ms apart: not one buffered lump
            times = [t for _, t, _ in got]
            assert times == sorted(times) and times[-1] <= loop.time()
            assert got[-1][0].endswith(events[-1]) and got[-1][2]
            assert not any(last for _, _, last in got[:-1])
            resp.close()
            assert up._pools and next(iter(up._pools.values())).idle == 1
            await up.close()

    run(main())


def test_a_relay_consumer_that_closes_the_response_wakes_wait_end() -> None:
    """A drain hand-off closes the response from the relay callback: the coroutine in
    wait_end gets ConnectionDropped at once (not the idle timeout) and the engine sees its
    connection go."""
    engine_saw_close = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD)
        try:
            for i in range(1000):
                writer.write(chunked(b"data: %d\n\n" % i))
                await writer.drain()
                await asyncio.sleep(0.01)
        except ConnectionError:
            engine_saw_close.set()

    async def main() -> None:
        async with serve(handle) as srv:
            up = _upstream(idle_timeout_s=60.0)
            loop = asyncio.get_running_loop()
            resp = await up.open(_engine(srv.port), "/v1/x", b"{}", {}, loop.time() + 60)
            got: list[bytes] = []

            def on_data(data: bytes, now: float, last: bool) -> bool:
                got.append(data)
                if len(got) == 3:
                    resp.close()
                return True

            resp.relay(on_data)
            with pytest.raises(UpstreamError) as err:
                await up.wait_end(resp, "engine-a", loop.time() + 60)
            assert err.value.outcome is Outcome.CONNECT_ERROR and len(got) == 3
            await asyncio.wait_for(engine_saw_close.wait(), 5.0)
            await up.close()

    run(main())


def test_relay_consumer_back_pressure_pauses_without_timing_out() -> None:
    """A consumer that cannot take more stops the connection reading; held back for
    longer than the idle timeout, the stream does not time out (the silence is ours),
    and after resume_reading every byte arrives."""
    total = 4 * 1024 * 1024
    piece = b"data: " + b"z" * 8000 + b"\n\n"

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD)
        sent = 0
        while sent < total:
            writer.write(chunked(piece))
            sent += len(piece)
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await read_request(reader)

    async def main() -> None:
        async with serve(handle) as srv:
            up = _upstream(idle_timeout_s=0.2)
            loop = asyncio.get_running_loop()
            resp = await up.open(_engine(srv.port), "/v1/x", b"{}", {}, loop.time() + 5)
            got: list[bytes] = []
            resp.relay(lambda data, now, last: got.append(data) is None and False)  # full
            end = asyncio.ensure_future(up.wait_end(resp, "engine-a", loop.time() + 10))
            await asyncio.sleep(0.6)  # three idle timeouts, held back by the consumer
            assert not end.done()
            assert resp._conn is not None and resp._conn.paused
            held = sum(map(len, got))
            assert held < total // 2
            for _ in range(10_000):  # bounded: one resume per read
                if end.done():
                    break
                resp.resume_reading()
                await asyncio.sleep(0.001)
            await end
            assert sum(map(len, got)) >= total and b"".join(got).endswith(b"\n\n")
            resp.close()
            await up.close()

    run(main())


def test_drop_mid_body_is_connect_error() -> None:
    """Drop mid body is connect error."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()
        await asyncio.sleep(0.05)

    async def main() -> None:
        async with serve(handle) as srv:
            up = _upstream()
            loop = asyncio.get_running_loop()
            resp = await up.open(_engine(srv.port), "/v1/x", b"{}", {}, loop.time() + 5)
            with pytest.raises(UpstreamError) as err:
                await up.read_body(resp, "engine-a", loop.time() + 5)
            assert err.value.outcome is Outcome.CONNECT_ERROR and err.value.status == 502
            assert err.value.message.startswith("engine engine-a failed mid-response")
            resp.close()
            await up.close()

    run(main())


def test_oversized_body(monkeypatch: pytest.MonkeyPatch) -> None:
    """Oversized body."""
    monkeypatch.setattr(upstream, "MAX_ERROR_BODY_BYTES", 1000)

    async def main() -> None:
        async with serve(keepalive_handler(b"x" * 5000)) as srv:
            up = _upstream()
            loop = asyncio.get_running_loop()
            resp = await up.open(_engine(srv.port), "/v1/x", b"{}", {}, loop.time() + 5)
            with pytest.raises(UpstreamError) as err:
                await up.read_body(resp, "engine-a", loop.time() + 5)
            assert err.value.outcome is Outcome.HTTP_5XX
            resp.close()
            await up.close()

    run(main())


def test_slow_reader_buffer_stays_bounded() -> None:
    """Slow reader buffer stays bounded."""
    total = 16 * 1024 * 1024
    piece = b"y" * 65536

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Length: {total}\r\n\r\n".encode())
        for _ in range(total // len(piece)):
            writer.write(piece)
            await writer.drain()  # blocks once the client stops reading: backpressure
        await read_request(reader)

    async def main() -> None:
        async with serve(handle) as srv:
            p = pool(srv)
            loop = asyncio.get_running_loop()
            resp = await p.request("/x", b"", [], deadline=loop.time() + 2, connect_timeout_s=1)
            await asyncio.sleep(0.3)  # a stalled reader: the server keeps sending
            assert http1.HIGH_WATER < resp._buffered <= http1.HIGH_WATER + 512 * 1024
            assert resp._conn is not None and resp._conn.paused
            got = 0
            peak = 0
            while chunk := await resp.read(2.0, loop.time() + 10):
                got += len(chunk)
                peak = max(peak, len(chunk))
                await asyncio.sleep(0)
            assert got == total
            assert peak <= http1.HIGH_WATER + 512 * 1024
            resp.close()
            assert p.idle == 1  # complete: pooled (and no longer paused)
            p.close()

    run(main())


def test_connection_close_response_not_pooled() -> None:
    """Connection close response not pooled."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(ok(b"bye", "Connection: close\r\n"))
        await asyncio.sleep(0.2)  # the server lingers: the client must not reuse it

    async def main() -> None:
        async with serve(handle) as srv:
            p = pool(srv)
            assert await fetch(p) == b"bye"
            assert p.idle == 0
            assert await fetch(p) == b"bye"
            assert srv.accepted == 2
            p.close()

    run(main())


def test_body_until_eof() -> None:
    """Body until eof."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")

    async def main() -> None:
        async with serve(handle) as srv:
            p = pool(srv)
            assert await fetch(p) == b"until the end"
            assert p.idle == 0
            p.close()

    run(main())


def test_response_closed_mid_body_drops_connection() -> None:
    """Response closed mid body drops connection."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while await read_request(reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")

    async def main() -> None:
        async with serve(handle) as srv:
            p = pool(srv)
            loop = asyncio.get_running_loop()
            resp = await p.request("/x", b"", [], deadline=loop.time() + 2, connect_timeout_s=1)
            assert await resp.read(1.0, loop.time() + 1) == b"abc"
            resp.close()
            assert p.idle == 0 and p.size == 0
            p.close()

    run(main())


def test_concurrency_bounded_by_pool_limit() -> None:
    """Concurrency bounded by pool limit."""
    limit = 4

    async def main() -> None:
        async with serve(keepalive_handler(b"r", delay=0.01)) as srv:
            p = pool(srv, limit=limit)
            results = await asyncio.gather(*(fetch(p, wait_s=10.0) for _ in range(100)))
            assert results == [b"r"] * 100
            assert srv.accepted <= limit and srv.max_open <= limit and p.opened <= limit
            assert p.size <= limit
            p.close()

    run(main())


def test_idle_connections_expire() -> None:
    """Idle connections expire."""

    async def main() -> None:
        async with serve(keepalive_handler()) as srv:
            p = pool(srv, keepalive_s=0.1)
            await fetch(p)
            assert p.idle == 1
            await asyncio.sleep(0.3)
            assert p.idle == 0 and p.size == 0
            p.close()

    run(main())


def test_header_injection_rejected() -> None:
    """Header injection rejected."""

    async def main() -> None:
        async with serve(keepalive_handler()) as srv:
            p = pool(srv)
            loop = asyncio.get_running_loop()
            with pytest.raises(ValueError):
                await p.request(
                    "/x",
                    b"",
                    [("X-A", "1\r\nX-B: 2")],
                    deadline=loop.time() + 1,
                    connect_timeout_s=1,
                )
            p.close()

    run(main())


def test_oversized_head_is_protocol_error() -> None:
    """Oversized head is protocol error."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for i in range(2000):
            writer.write(b"X-Pad-%d: %s\r\n" % (i, b"p" * 100))
            await writer.drain()
        await asyncio.sleep(0.2)

    async def main() -> None:
        async with serve(handle) as srv:
            p = pool(srv)
            with pytest.raises(http1.ProtocolError):
                await fetch(p)
            p.close()

    run(main())


def test_malformed_response_is_protocol_error() -> None:
    """Malformed response is protocol error."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await asyncio.sleep(0.2)

    async def main() -> None:
        async with serve(handle) as srv:
            p = pool(srv)
            with pytest.raises(http1.ProtocolError):
                await fetch(p)
            p.close()

    run(main())


async def _complete_body(up: UpstreamPool, resp: http1.Response, timeout_s: float = 5.0) -> bytes:
    """Poll ``complete_body`` until the body is there (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (data := up.complete_body(resp, "engine-a")) is None:
        assert loop.time() < deadline, "the body never completed"
        await asyncio.sleep(0.005)
    return data


def test_complete_body_only_once_the_whole_body_arrived() -> None:
    """complete_body: None while the body is partial (nothing consumed), the whole body
    once it ended; the connection is then pooled for the next request."""
    release = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while await read_request(reader) is not None:
            if n == 1 and not release.is_set():
                whole = ok(b'{"part":"one","two":2}')
                writer.write(whole[:-6])
                await writer.drain()
                await release.wait()
                writer.write(whole[-6:])
            else:
                writer.write(ok(b"{}"))
            await writer.drain()

    async def main() -> None:
        async with serve(handle) as srv:
            up = _upstream()
            loop = asyncio.get_running_loop()
            resp = await up.open(_engine(srv.port), "/v1/x", b"{}", {}, loop.time() + 5)
            assert up.complete_body(resp, "engine-a") is None
            release.set()
            assert await _complete_body(up, resp) == b'{"part":"one","two":2}'
            resp.close()
            again = await up.open(_engine(srv.port), "/v1/x", b"{}", {}, loop.time() + 5)
            assert await _complete_body(up, again) == b"{}"
            again.close()
            assert srv.accepted == 1  # the first connection was reused
            await up.close()

    run(main())


def test_complete_body_oversized(monkeypatch: pytest.MonkeyPatch) -> None:
    """A complete body over MAX_ERROR_BODY_BYTES fails as read_body does."""
    monkeypatch.setattr(upstream, "MAX_ERROR_BODY_BYTES", 1000)

    async def main() -> None:
        async with serve(keepalive_handler(b"x" * 5000)) as srv:
            up = _upstream()
            loop = asyncio.get_running_loop()
            resp = await up.open(_engine(srv.port), "/v1/x", b"{}", {}, loop.time() + 5)
            with pytest.raises(UpstreamError) as err:
                await _complete_body(up, resp)
            assert err.value.outcome is Outcome.HTTP_5XX
            resp.close()
            await up.close()

    run(main())
