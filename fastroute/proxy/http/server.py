"""The lean HTTP/1.1 front end of ``fastroute serve``: ``asyncio.Protocol`` + httptools.

aiohttp's server (request objects, router, middleware, ``StreamResponse``) cost about as
much CPU per proxied request as a whole Rust router; this server parses with httptools
(llhttp), hands each request to :meth:`fastroute.proxy.proxy_app.ProxyApp.dispatch` and
writes the answer to the transport itself. The application (routes, lifecycle, reload)
is a :class:`~fastroute.proxy.proxy_app.ProxyApp`, started before the server.

Behaviour
---------
* Keep-alive (HTTP/1.1 default; HTTP/1.0 connections close after one response). An idle
  connection (no complete request) is closed after ``keepalive_s``; one whose request head
  has been trickling in for ``limits.header_timeout_s`` is closed too (slowloris), and one
  whose client read nothing for ``limits.write_stall_timeout_s`` is dropped.
* Pipelining: requests on one connection are answered in order, one at a time; at most
  :data:`MAX_PIPELINED` wait, then reading pauses.
* Body limit: a body over ``limits.max_body_bytes`` (the audio endpoints:
  ``limits.max_audio_body_bytes``, if larger) is not kept (its bytes are counted
  and dropped; past :data:`MAX_DISCARD_BYTES` the connection is closed) and the request
  path answers 413. ``Expect: 100-continue`` is answered unless the declared length is
  already over the limit.
* Streams use chunked transfer encoding; :meth:`_StreamSink.write` waits while the
  transport's buffer is over its high-water mark (back-pressure, nothing buffered
  without bound).
* A client that disconnects cancels its request's task (the upstream request is closed
  on the way out), like aiohttp's ``handler_cancellation``.
* :meth:`LeanServer.drain`: stop listening, close idle connections, let busy ones finish
  their current response (then close) up to a deadline, then cancel what is left.
* Every response carries ``x-request-id`` and ``x-fastroute-worker``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import socket
from collections.abc import Callable, Iterator, Mapping
from http import HTTPStatus
from typing import Any

import httptools

from fastroute.proxy.http.openai_errors import error_reply
from fastroute.proxy.http.reply import Headers
from fastroute.proxy.path.endpoints import AUDIO_PREFIX
from fastroute.proxy.path.handler import new_request_id
from fastroute.proxy.proxy_app import ProxyApp

__all__ = [
    "LeanServer",
    "HeaderView",
    "worker_pid",
    "MAX_PIPELINED",
    "MAX_DISCARD_BYTES",
    "MAX_HEADER_BYTES",
]

logger = logging.getLogger(__name__)

#: Most requests read ahead on one connection while an earlier one is being answered.
MAX_PIPELINED = 8
#: Most bytes of an over-limit body read and dropped before the connection is closed.
MAX_DISCARD_BYTES = 64 * 1024 * 1024
_AUDIO_PREFIX = AUDIO_PREFIX.encode()
#: Most bytes of request line + headers of one request (431 beyond).
MAX_HEADER_BYTES = 64 * 1024
#: Most seconds between sweeps for idle keep-alive connections (half the keep-alive
#: time when that is shorter).
_SWEEP_S = 5.0

_STATUS_LINES: dict[int, bytes] = {
    s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in HTTPStatus
}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


# The pid as a header value, formatted once per process (os.getpid() is a syscall).
_worker_pid = str(os.getpid())


def _reset_worker_pid() -> None:
    global _worker_pid
    _worker_pid = str(os.getpid())


os.register_at_fork(after_in_child=_reset_worker_pid)


def worker_pid() -> str:
    """This process's pid as the ``x-fastroute-worker`` header value."""
    return _worker_pid


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return line if line is not None else f"HTTP/1.1 {status} Status\r\n".encode()


#: Most header names whose lookup key is cached (the request path asks for a handful).
_MAX_LOOKUP_KEYS = 256
_LOOKUP_KEYS: dict[str, bytes] = {}


def _lookup_key(name: str) -> bytes:
    """``name`` lowercased and encoded, as :class:`HeaderView` keys its values; cached."""
    key = name.lower().encode("utf-8", "surrogateescape")
    if len(_LOOKUP_KEYS) >= _MAX_LOOKUP_KEYS:
        _LOOKUP_KEYS.clear()
    _LOOKUP_KEYS[name] = key
    return key


class HeaderView(Mapping[str, str]):
    """Request headers as received, looked up case-insensitively, decoded on access.

    ``get`` returns the first value of a name, as ``CIMultiDict.get`` does. Built from
    the raw pairs without decoding them all: a request reads only a few headers by
    name, and the forwarded ones are relayed as bytes (``raw_headers``).
    """

    __slots__ = ("_raw", "_first_by_name")

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self._raw = raw
        self._first_by_name: dict[bytes, bytes] | None = None

    @property
    def _first(self) -> dict[bytes, bytes]:
        """Lowercase name -> first value, built on the first lookup."""
        first = self._first_by_name
        if first is None:
            first = self._first_by_name = {}
            for name, value in self._raw:
                first.setdefault(name.lower(), value)
        return first

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        first = self._first_by_name
        if first is None:
            first = self._first
        key = _LOOKUP_KEYS.get(name)
        if key is None:
            key = _lookup_key(name)
        value = first.get(key)
        return default if value is None else value.decode("utf-8", "surrogateescape")

    def __getitem__(self, name: str) -> str:
        value = self.get(name)
        if value is None:
            raise KeyError(name)
        return str(value)

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        key = _LOOKUP_KEYS.get(name)
        return (key if key is not None else _lookup_key(name)) in self._first

    def __iter__(self) -> Iterator[str]:
        return (n.decode("utf-8", "surrogateescape") for n, _ in self._raw)

    def __len__(self) -> int:
        return len(self._raw)

    def items(self) -> list[tuple[str, str]]:  # type: ignore[override]
        """Every (name, value) pair, in order, repeated names included."""
        return [
            (n.decode("utf-8", "surrogateescape"), v.decode("utf-8", "surrogateescape"))
            for n, v in self._raw
        ]


class _Request:
    """One parsed request (:class:`fastroute.proxy.path.handler.Incoming`)."""

    __slots__ = ("method", "path", "headers", "raw_headers", "body", "keep_alive")

    def __init__(
        self,
        method: str,
        path: str,
        raw_headers: list[tuple[bytes, bytes]],
        body: bytes | None,
        keep_alive: bool,
    ) -> None:
        self.method = method
        self.path = path
        self.raw_headers = raw_headers
        self.headers = HeaderView(raw_headers)
        self.body = body
        self.keep_alive = keep_alive


class _StreamSink:
    """Chunked response body on a connection (:class:`fastroute.proxy.http.reply.Sink`)."""

    __slots__ = ("conn", "rid", "started", "ended")

    def __init__(self, conn: _Connection, rid: str) -> None:
        self.conn = conn
        self.rid = rid
        self.started = False
        self.ended = False

    async def start(self, status: int, headers: Headers, raw_head: bytes = b"") -> None:
        conn = self.conn
        if conn.lost:
            raise ConnectionResetError("client disconnected")
        self.started = True
        conn.transport.write(
            conn.head(status, headers, self.rid, b"Transfer-Encoding: chunked\r\n", raw=raw_head)
        )

    async def write(self, data: bytes) -> None:
        conn = self.conn
        if conn.lost:
            raise ConnectionResetError("client disconnected")
        if data:
            conn.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
            if conn.write_paused:
                await conn.wait_writable()

    async def end(self) -> None:
        conn = self.conn
        if conn.lost:
            raise ConnectionResetError("client disconnected")
        if not self.ended:
            self.ended = True
            conn.transport.write(b"0\r\n\r\n")

    def splice(self) -> _StreamSink:
        return self

    def write_now(self, data: bytes, last: bool = False) -> bool:
        conn = self.conn
        if conn.lost:
            return True  # connection_lost cancelled the request; drop the chunk
        if last:
            # The body's end in the same write: one syscall less per stream, and the
            # client sees [DONE] and the end together (its connection is reusable at once).
            self.ended = True
            conn.transport.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data))
        else:
            conn.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return not conn.write_paused

    def on_writable(self, callback: Callable[[], None] | None) -> None:
        self.conn.writable_callback = callback


class _Connection(asyncio.Protocol):
    """One client connection: parse, answer in order, write."""

    def __init__(self, server: LeanServer) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: Any = None
        self.parser = httptools.HttpRequestParser(self)
        self.remote: str | None = None
        self.pending: collections.deque[_Request] = collections.deque()
        self.task: asyncio.Task[None] | None = None
        self.idle_since = self.loop.time()
        self.close_after = False  # draining, or a parse error queued behind requests
        self.lost = False
        self.write_paused = False
        self.reading_paused = False
        self._stall_timer: asyncio.TimerHandle | None = None
        self._writable: asyncio.Future[None] | None = None
        #: Called when the transport drained (a spliced relay resumes its engine).
        self.writable_callback: Callable[[], None] | None = None
        self.head_received = 0
        self.head_started = 0.0  # loop time of a pending head's first byte
        self.messages = 0  # requests parsed whole on this connection
        self._reset_message()

    def _reset_message(self) -> None:
        self.url = b""
        self.in_head = True
        self.raw: list[bytes] = []  # header names and values, alternating, as received
        self.pairs: list[tuple[bytes, bytes]] = []
        self.parts: list[bytes] = []
        self.size = 0
        self.too_large = False
        self.answered_early = False  # 413 sent at the headers (Expect: 100-continue)
        self.limit = 0

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.remote = peer[0] if isinstance(peer, tuple) and peer else None
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._stall_timer is not None:
            self._stall_timer.cancel()
        self.server.forget(self)
        self.pending.clear()
        if self.task is not None:
            self.task.cancel()
        waiter = self._writable
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionResetError("client disconnected"))

    def pause_writing(self) -> None:
        self.write_paused = True
        if self._stall_timer is not None:
            self._stall_timer.cancel()
        stall_s = self.server.app.context.config.limits.write_stall_timeout_s
        self._stall_timer = self.loop.call_later(stall_s, self._stalled)

    def _stalled(self) -> None:
        """The client read nothing for ``limits.write_stall_timeout_s``: drop it (abort,
        a close would wait for the buffer to flush); ``connection_lost`` cancels its task."""
        self._stall_timer = None
        if self.write_paused and not self.lost:
            self.transport.abort()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        if self.writable_callback is not None:
            self.writable_callback()
        waiter = self._writable
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait_writable(self) -> None:
        """Wait until the transport's buffer drained below its low-water mark."""
        while self.write_paused:
            if self.lost:
                raise ConnectionResetError("client disconnected")
            self._writable = self.loop.create_future()
            try:
                await self._writable
            finally:
                self._writable = None

    def data_received(self, data: bytes) -> None:
        # Bytes received while a request's head is incomplete (httptools buffers a
        # partial header without bound): at most one read beyond MAX_HEADER_BYTES.
        counting = self.in_head
        if counting and self.head_received == 0:
            self.head_started = self.loop.time()
        messages = self.messages
        try:
            self.parser.feed_data(data)
            if self.messages != messages:
                # A request ended in this read: a head after it starts afresh (its bytes
                # here are not counted, as at most one read beyond the bound). Counted,
                # the request's own bytes kept the first one's arrival as the head's start
                # and the sweep closed the idle keep-alive connection as slowloris.
                self.head_received = 0
            elif counting and self.in_head:
                self.head_received += len(data)
                if self.head_received > MAX_HEADER_BYTES:
                    raise _HeaderTooLarge
        except httptools.HttpParserUpgrade:
            self._fail(400, "Protocol upgrades are not supported.", "bad_request")
        except httptools.HttpParserError as exc:
            self._fail(400, f"Malformed HTTP request: {exc}.", "bad_request")
        except _HeaderTooLarge:
            self._fail(
                431, f"Request headers exceed {MAX_HEADER_BYTES} bytes.", "headers_too_large"
            )

    # -- httptools callbacks -----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._reset_message()
        self.limit = self.server.app.context.config.limits.max_body_bytes

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > MAX_HEADER_BYTES:
            raise _HeaderTooLarge

    def on_header(self, name: bytes, value: bytes) -> None:
        self.raw.append(name)
        self.raw.append(value)

    def on_headers_complete(self) -> None:
        self.in_head = False
        self.head_received = 0
        raw = self.raw
        if sum(map(len, raw)) + len(self.url) > MAX_HEADER_BYTES:
            raise _HeaderTooLarge
        self.pairs = pairs = list(zip(raw[::2], raw[1::2], strict=True))
        length = expect_value = None
        for name, value in pairs:
            n = len(name)  # cheap pre-test: only two names matter here
            if n == 14 and length is None and name.lower() == b"content-length":
                length = value
            elif n == 6 and expect_value is None and name.lower() == b"expect":
                expect_value = value
        declared = int(length) if length is not None and length.strip().isdigit() else None
        expect = expect_value is not None and expect_value.strip().lower() == b"100-continue"
        if declared is not None and declared > self.limit and self._over_limit(declared):
            self.too_large = True
            if expect:
                # The client waits for our verdict before sending the body: answer 413
                # now and close after it (the body is never read).
                self._queue(self._request(keep_alive=False))
                self.close_after = True
                self.answered_early = True
                self._pause_reading()
        elif expect and not self.lost:
            self.transport.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.too_large or (self.size > self.limit and self._over_limit(self.size)):
            self.too_large = True
            self.parts = []
            if self.size > MAX_DISCARD_BYTES:
                self.transport.close()
            return
        self.parts.append(body)

    def _over_limit(self, size: int) -> bool:
        """``size`` is over the request's body limit: ``limits.max_body_bytes``, or for the
        audio endpoints the larger of it and ``limits.max_audio_body_bytes`` (the request
        path holds them to the audio limit). Only asked once a body is over the first."""
        if self.url.startswith(_AUDIO_PREFIX):
            limits = self.server.app.context.config.limits
            self.limit = max(limits.max_body_bytes, limits.max_audio_body_bytes)
        return size > self.limit

    def on_message_complete(self) -> None:
        self.messages += 1
        if self.answered_early:
            return
        request = self._request(
            self.parser.should_keep_alive() and self.parser.get_http_version() == "1.1"
        )
        self._reset_message()
        self._queue(request)

    def _request(self, keep_alive: bool) -> _Request:
        url = self.url
        q = url.find(b"?")
        path = (url if q < 0 else url[:q]).decode("utf-8", "surrogateescape")
        if self.too_large:
            body = None
        else:
            parts = self.parts
            body = parts[0] if len(parts) == 1 else b"".join(parts)
        return _Request(
            self.parser.get_method().decode("ascii", "replace"),
            path,
            self.pairs,
            body,
            keep_alive,
        )

    def _queue(self, request: _Request) -> None:
        if self.task is None and not self.pending:
            self._start(request)
        else:
            self.pending.append(request)
            if len(self.pending) >= MAX_PIPELINED:
                self._pause_reading()

    def _pause_reading(self) -> None:
        if not self.reading_paused and not self.lost:
            self.reading_paused = True
            self.transport.pause_reading()

    # -- answering -----------------------------------------------------------------------------

    def _start(self, request: _Request) -> None:
        self.idle_since = -1.0
        self.task = self.loop.create_task(self._serve(request))

    async def _serve(self, request: _Request) -> None:
        rid = new_request_id()
        sink = _StreamSink(self, rid)
        keep_alive = request.keep_alive and not self.close_after
        try:
            reply = await self.server.app.dispatch(request, self.remote, sink, rid)
            if not reply.streamed and not self.lost:
                keep_alive = keep_alive and not self.close_after
                head = self.head(
                    reply.status,
                    reply.headers,
                    rid,
                    b"Content-Length: %d\r\n" % len(reply.body),
                    keep_alive,
                    reply.raw_head,
                )
                body = b"" if request.method == "HEAD" else reply.body
                self.transport.write(head + body)
        except asyncio.CancelledError:
            raise
        except ConnectionResetError:
            keep_alive = False
        except Exception:
            logger.exception("unhandled error serving %s %s", request.method, request.path)
            keep_alive = False
            if not sink.started and not self.lost:
                reply = error_reply(500, "Internal proxy error.", code="internal_error")
                self.transport.write(
                    self.head(500, reply.headers, rid, b"Content-Length: %d\r\n" % len(reply.body))
                    + reply.body
                )
        finally:
            self.task = None
        self._next(keep_alive)

    def _next(self, keep_alive: bool) -> None:
        if self.lost:
            return
        if not keep_alive or self.close_after:
            self.transport.close()
            return
        if self.pending:
            request = self.pending.popleft()
            if self.reading_paused and len(self.pending) < MAX_PIPELINED // 2:
                self.reading_paused = False
                self.transport.resume_reading()
            self._start(request)
        else:
            self.idle_since = self.loop.time()
            if self.reading_paused:
                self.reading_paused = False
                self.transport.resume_reading()

    def head(
        self,
        status: int,
        headers: Headers,
        rid: str,
        framing: bytes,
        keep_alive: bool = True,
        raw: bytes = b"",
    ) -> bytes:
        """Status line and headers, with the proxy's own and the framing header.

        ``raw``: header lines already encoded, sent first.
        """
        own = b"x-request-id: %b\r\n%b" % (rid.encode(), self.server.worker_line)
        if headers:
            text = "".join([f"{name}: {value}\r\n" for name, value in headers])
            own = text.encode("utf-8", "surrogateescape") + own
        if not keep_alive:
            own += b"Connection: close\r\n"
        return b"%b%b%b%b\r\n" % (_status_line(status), raw, own, framing)

    def _fail(self, status: int, message: str, code: str) -> None:
        """A request could not be parsed: answer it (after those before it), then close."""
        self.close_after = True
        self._pause_reading()
        if self.task is not None or self.pending:
            return  # the connection closes after the requests already read
        reply = error_reply(status, message, code=code)
        self.transport.write(
            self.head(
                status,
                reply.headers,
                new_request_id(),
                b"Content-Length: %d\r\n" % len(reply.body),
                False,
            )
            + reply.body
        )
        self.transport.close()


class _HeaderTooLarge(Exception):
    """The request line and headers exceeded :data:`MAX_HEADER_BYTES`."""


class LeanServer:
    """The listener and connections of one worker.

    Parameters
    ----------
    app : ProxyApp
        Already started (``await app.start()``); :meth:`drain` marks it draining, the
        caller stops it afterwards.
    keepalive_s : float
        Idle keep-alive connections (and connections that do not complete a request)
        are closed after this many seconds.
    """

    def __init__(self, app: ProxyApp, *, keepalive_s: float = 75.0) -> None:
        self.app = app
        self.keepalive_s = keepalive_s
        self._sweep_s = min(_SWEEP_S, keepalive_s / 2)
        self.loop = asyncio.get_running_loop()
        self.pid = worker_pid()
        #: The ``x-fastroute-worker`` header line, encoded once.
        self.worker_line = f"x-fastroute-worker: {self.pid}\r\n".encode()
        self.connections: set[_Connection] = set()
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        self._all_closed: asyncio.Event | None = None

    @property
    def draining(self) -> bool:
        """:meth:`drain` was called."""
        return self._all_closed is not None

    async def start(self, host: str, port: int, *, reuse_port: bool = False) -> int:
        """Listen on ``host:port``; return the bound port (``port`` 0 picks one)."""
        self._server = await self.loop.create_server(
            lambda: _Connection(self), host, port, reuse_port=reuse_port, backlog=1024
        )
        self._sweeper = self.loop.call_later(self._next_sweep_s(), self._sweep)
        sock = self._server.sockets[0]
        return int(sock.getsockname()[1])

    def forget(self, conn: _Connection) -> None:
        """A connection closed."""
        self.connections.discard(conn)
        if not self.connections and self._all_closed is not None:
            self._all_closed.set()

    def _sweep(self) -> None:
        now = self.loop.time()
        cutoff = now - self.keepalive_s
        head_cutoff = now - self.app.context.config.limits.header_timeout_s
        for conn in list(self.connections):
            if conn.task is not None:
                continue
            if 0.0 <= conn.idle_since < cutoff:
                conn.transport.close()
            elif conn.in_head and conn.head_received and conn.head_started < head_cutoff:
                conn.transport.close()  # slowloris: a head trickling in past its bound
        self._sweeper = self.loop.call_later(self._next_sweep_s(), self._sweep)

    def _next_sweep_s(self) -> float:
        """Seconds to the next sweep: both bounds are checked at half their length."""
        return min(self._sweep_s, self.app.context.config.limits.header_timeout_s / 2)

    async def drain(self, timeout_s: float) -> None:
        """Stop listening; let busy connections finish their current response.

        Idle connections close at once; busy ones close after their current response;
        after ``timeout_s`` the remaining requests are cancelled and their connections
        closed.
        """
        self.app.begin_drain()
        if self._server is not None:
            self._server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self._all_closed = asyncio.Event()
        for conn in list(self.connections):
            conn.close_after = True
            conn.pending.clear()
            if conn.task is None:
                conn.transport.close()
        if self.connections:
            try:
                await asyncio.wait_for(self._all_closed.wait(), timeout_s)
            except TimeoutError:
                logger.warning(
                    "drain: %d connections still busy after %.1f s; closing them",
                    len(self.connections),
                    timeout_s,
                )
        for conn in list(self.connections):
            if conn.task is not None:
                conn.task.cancel()
            conn.transport.close()
        if self.connections:
            # Closed transports report connection_lost on a later loop iteration.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._all_closed.wait(), 1.0)
