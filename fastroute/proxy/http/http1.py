"""A lean keep-alive HTTP/1.1 client for proxying requests to engines.

Why not aiohttp's client: per request it builds a ``ClientRequest`` (URL parsing, auto
headers, cookie jar, tracing hooks) and callers wrap every wait in an
``asyncio.timeout()``; profiles put that at ~20 % of the proxy's CPU per request and
~9 % of the streaming phase. This client does only what proxying to a known engine
needs:

* one :class:`HostPool` per engine (``host:port``): a bounded set of keep-alive
  connections (at most ``limit``, in use + idle + being opened), idle ones reused
  most-recently-used first and closed after ``keepalive_s`` of idleness;
* connections are :class:`asyncio.Protocol` objects parsed by httptools' C
  ``HttpResponseParser`` (status line, headers, ``Content-Length``, chunked bodies);
* a request is one ``transport.write`` of pre-encoded bytes: the request line and fixed
  headers are encoded once per (engine, path), the per-request headers once per request;
* the body reaches the reader through a bounded buffer: above :data:`HIGH_WATER` bytes
  the transport stops reading until the reader drains it (TCP pushes back on the engine);
* timeouts cost one ``loop.call_at`` timer per response that is re-armed lazily: each
  wait only stores its deadline; when the timer fires it either re-arms itself for the
  latest deadline or fails the wait;
* a connection returns to its pool only after a complete response the server allows
  to be kept alive, and only if the reader did not close it first;
* a request sent on a *reused* connection that the peer closed before any response byte
  (the keep-alive race: the server timed the idle connection out as we sent) is retried
  once on another connection. A fresh connection is never retried.

Errors are :class:`HTTP1Error` subclasses; :mod:`fastroute.proxy.http.upstream` maps them to
its client-safe :class:`~fastroute.proxy.http.upstream.UpstreamError`.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import Callable, Iterable
from typing import cast
from urllib.parse import quote, urlsplit

import httptools
from multidict import CIMultiDict

__all__ = [
    "HIGH_WATER",
    "MAX_HEAD_BYTES",
    "ConnectError",
    "ConnectTimeout",
    "ConnectionDropped",
    "HTTP1Error",
    "HostPool",
    "ProtocolError",
    "pool_for_url",
    "Response",
    "ResponseTimeout",
]

#: Body bytes buffered for a reader before the connection stops reading. The buffer may
#: exceed it by at most one read of the transport (<= 256 KiB on uvloop and asyncio).
HIGH_WATER = 256 * 1024
#: Largest response head (status line + headers); beyond it the response is malformed.
MAX_HEAD_BYTES = 64 * 1024
#: Most (path -> encoded request head) entries cached per pool; the proxy uses a handful
#: of fixed paths, the cap only guards against a caller passing arbitrary ones.
_MAX_CACHED_PATHS = 64
#: A timer may fire this much before its deadline (libuv timers have 1 ms granularity).
_TIMER_SLACK_S = 1e-3
#: Request headers the client sets itself; callers' values for them are dropped.
_RESERVED = frozenset({"host", "content-length", "connection", "transfer-encoding", "keep-alive"})
#: Path characters sent as-is; everything else is percent-encoded (no CR/LF/space).
_PATH_SAFE = "/%:@!$&'()*+,;=-._~?"


class HTTP1Error(Exception):
    """Base of this client's errors."""


class ConnectError(HTTP1Error):
    """The TCP (or TLS) connection could not be established."""


class ConnectTimeout(HTTP1Error, TimeoutError):
    """The TCP (or TLS) connection was not established in time."""


class ResponseTimeout(HTTP1Error, TimeoutError):
    """No response headers, or no body bytes, arrived before the deadline."""


class ConnectionDropped(HTTP1Error):
    """The connection closed or broke before the response was complete."""


class ProtocolError(HTTP1Error):
    """The server sent something that is not a valid HTTP/1.1 response."""


class _StaleConnection(ConnectionDropped):
    """A reused connection closed before any response byte (the keep-alive race)."""


class Response:
    """One response being received.

    Attributes
    ----------
    status : int
        HTTP status code.
    headers : multidict.CIMultiDict[str]
        Response headers as received (hop-by-hop ones included), decoded on first use.
    raw_headers : list of (bytes, bytes)
        The same, undecoded, in order (a proxy relays them without decoding).
    """

    __slots__ = (
        "status",
        "raw_headers",
        "_headers",
        "_content_type",
        "_conn",
        "_loop",
        "_chunks",
        "_buffered",
        "_paused",
        "_head_done",
        "_head_bytes",
        "_got_bytes",
        "_until_eof",
        "_eof",
        "_exc",
        "_closed",
        "_waiter",
        "_deadline",
        "_timer",
        "_timer_at",
        "_relay",
        "_idle_s",
        "_last_at",
    )

    def __init__(self, conn: _Connection, loop: asyncio.AbstractEventLoop) -> None:
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self._headers: CIMultiDict[str] | None = None
        self._content_type: bytes | None = None
        self._conn: _Connection | None = conn
        self._loop = loop
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._head_done = False
        self._head_bytes = 0
        self._got_bytes = False
        self._until_eof = False
        self._eof = False
        self._exc: HTTP1Error | None = None
        self._closed = False
        self._waiter: asyncio.Future[None] | None = None
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._relay: Callable[[bytes, float, bool], bool] | None = None
        self._idle_s = 0.0
        self._last_at = 0.0

    @property
    def headers(self) -> CIMultiDict[str]:
        """The response headers (hop-by-hop ones included), case-insensitive."""
        headers = self._headers
        if headers is None:
            headers = self._headers = CIMultiDict(
                (n.decode("utf-8", "surrogateescape"), v.decode("utf-8", "surrogateescape"))
                for n, v in self.raw_headers
            )
        return headers

    @property
    def content_type(self) -> str:
        """The media type of ``Content-Type``, lowercase, without parameters.

        ``application/octet-stream`` when absent (RFC 9110 §8.3), as aiohttp reports it.
        """
        ct = self._content_type
        if not ct:
            return "application/octet-stream"
        return ct.split(b";", 1)[0].strip().lower().decode("latin-1")

    def close(self) -> None:
        """Stop receiving: drop the connection unless the body was read to its end.

        A connection closed mid-response cannot be reused (the rest of the body would
        be read as the next response), so it is closed, not pooled. No-op when the
        response was complete. A coroutine waiting on the response (:meth:`wait_end` of
        a relay whose consumer closed it from its callback) gets ``ConnectionDropped``.
        """
        if self._closed:
            return
        self._closed = True
        self._stop_timer()
        self._chunks.clear()
        self._buffered = 0
        conn = self._conn
        if conn is not None:
            self._conn = None
            conn.discard()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionDropped("response closed"))

    def complete_body(self) -> bytes | None:
        """The whole body if it already arrived to its end, else None (nothing read).

        A small response usually arrives with its head: the caller then needs no
        wait, no timer and no coroutine. Reading it consumes the buffer, like
        :meth:`read`.
        """
        if not self._eof or self._exc is not None or self._closed:
            return None
        return self._take() if self._chunks else b""

    async def read(self, wait_s: float, deadline: float) -> bytes:
        """Every body byte buffered so far, waiting up to ``wait_s`` for some.

        Parameters
        ----------
        wait_s : float
            Most seconds to wait when nothing is buffered.
        deadline : float
            ``loop.time()`` past which no wait extends (caps ``wait_s``).

        Returns
        -------
        bytes
            The buffered bytes, joined; ``b""`` at the end of the body.

        Raises
        ------
        ResponseTimeout
            Nothing arrived in time.
        ConnectionDropped, ProtocolError
            The connection broke or the body is malformed.
        """
        if self._chunks:
            return self._take()  # the relay loop's common case: no clock read, no timer
        if self._exc is None and not self._eof:
            at = self._loop.time() + wait_s
            await self._wait(at if at < deadline else deadline)
            if self._chunks:
                return self._take()
        if self._exc is not None:
            raise self._exc
        return b""

    def relay(self, on_data: Callable[[bytes, float, bool], bool]) -> None:
        """Hand the body to ``on_data`` as it arrives, without buffering.

        ``on_data(data, now, last)`` runs in the connection's ``data_received``, once per
        read with that read's body chunks joined (``now`` is ``loop.time()``; ``last``:
        the body ended in this read, so the consumer can close its side in the same
        write), so relaying costs no wake-up of a waiting coroutine; it must not raise,
        and returns False when its consumer cannot take more: the connection then stops
        reading until :meth:`resume_reading`. Chunks buffered before the call are handed
        over first. Wait for the end with :meth:`wait_end`.
        """
        self._relay = on_data
        self._last_at = self._loop.time()
        self._hand_on()

    def resume_reading(self) -> None:
        """Read from the engine again (after a :meth:`relay` consumer returned False)."""
        if self._paused:
            self._paused = False
            self._last_at = self._loop.time()  # the idle timeout restarts from here
            if self._conn is not None:
                self._conn.resume()

    async def wait_end(self, idle_s: float, deadline: float) -> None:
        """Wait until a relayed body (:meth:`relay`) ended.

        Parameters
        ----------
        idle_s : float
            Most seconds without a chunk (the idle timeout); the timer follows the last
            chunk without being re-armed per chunk.
        deadline : float
            ``loop.time()`` by which the body must have ended.

        Raises
        ------
        ResponseTimeout
            No chunk for ``idle_s`` (or ``deadline`` passed).
        ConnectionDropped, ProtocolError
            The connection broke or the body is malformed.
        """
        self._idle_s = idle_s
        while self._exc is None and not self._eof:
            due = self._last_at + idle_s
            await self._wait(due if due < deadline else deadline, deadline)
        if self._exc is not None:
            raise self._exc

    # -- internals --------------------------------------------------------------------------

    def _hand_on(self) -> None:
        """Relaying: give the chunks of one read to the consumer, as one piece (one
        client write however many chunks the engine's read held). No-op when not
        relaying, closed, or nothing arrived."""
        relay = self._relay
        chunks = self._chunks
        if relay is None or not chunks or self._closed:
            return
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        now = self._last_at = self._loop.time()
        if not relay(data, now, self._eof):
            self._pause()

    def _pause(self) -> None:
        if not self._paused and self._conn is not None:
            self._paused = True
            self._conn.pause()

    def _take(self) -> bytes:
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        # Drained: let the transport read again (the engine's TCP window reopens).
        self.resume_reading()
        return data

    async def _wait_head(self, deadline: float) -> None:
        while not self._head_done and self._exc is None:
            await self._wait(deadline)
        if self._exc is not None:
            raise self._exc

    async def _wait(self, deadline: float, hard_deadline: float = 0.0) -> None:
        if self._closed:
            raise ConnectionDropped("response closed")
        waiter = self._loop.create_future()
        self._waiter = waiter
        # Relaying (hard_deadline set): the deadline moves with every chunk, see _on_timer.
        self._deadline = hard_deadline or deadline
        # Lazy timer: keep a pending timer that fires no later than this deadline; it
        # re-arms itself for the stored deadline when it fires early. A relay loop thus
        # schedules one timer per idle-timeout period, not one per chunk.
        if self._timer is None or self._timer_at > deadline:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._loop.call_at(deadline, self._on_timer)
            self._timer_at = deadline
        try:
            await waiter
        finally:
            self._waiter = None

    def _on_timer(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # nobody is waiting; the next wait arms a timer again
        due = self._deadline
        now = self._loop.time()
        if self._relay is not None:
            # Relaying: the idle deadline follows the last chunk; while the consumer
            # holds the engine back (paused) its silence is not the engine's fault.
            idle_due = (now if self._paused else self._last_at) + self._idle_s
            if idle_due < due:
                due = idle_due
        if due - now > _TIMER_SLACK_S:
            self._timer = self._loop.call_at(due, self._on_timer)
            self._timer_at = due
            return
        waiter.set_exception(ResponseTimeout("timed out"))

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, exc: HTTP1Error) -> None:
        if self._exc is None and not self._eof:
            self._exc = exc
        self._conn = None
        self._stop_timer()
        self._wake()

    def _on_body(self, data: bytes) -> None:
        if self._closed:
            return
        self._chunks.append(data)
        if self._relay is not None:
            return  # handed on once per read, by _Connection.data_received

        self._buffered += len(data)
        if self._buffered > HIGH_WATER:
            self._pause()
        self._wake()


class _Connection(asyncio.Protocol):
    """One keep-alive connection; parser callbacks feed the current :class:`Response`."""

    def __init__(self, pool: HostPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: Response | None = None
        self.reused = False
        self.closed = False
        self.paused = False
        self.idle_since = 0.0
        self._header_name = b""

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        resp = self.resp
        if resp is None:
            # Bytes on an idle connection: not a response to anything we sent.
            self.discard()
            return
        resp._got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            resp._hand_on()  # what was well-formed still reaches the client
            self._broken(ProtocolError(f"malformed response: {type(exc).__name__}"))
            return
        resp._hand_on()
        if not resp._head_done:
            # Still in the head: every byte so far was head (httptools buffers partial
            # header lines itself, so bound them here).
            resp._head_bytes += len(data)
            if resp._head_bytes > MAX_HEAD_BYTES:
                self._broken(ProtocolError("response head too large"))

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        resp = self.resp
        self.resp = None
        if resp is not None:
            if resp._head_done and resp._until_eof and exc is None:
                # Body delimited by the connection's end (no length, not chunked).
                resp._eof = True
                resp._conn = None
                resp._stop_timer()
                resp._wake()
            elif not resp._got_bytes and self.reused:
                resp._fail(_StaleConnection("connection closed by the server"))
            else:
                resp._fail(ConnectionDropped("connection closed by the server"))
        self.pool._forget(self)

    # -- httptools callbacks ----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        resp = self.resp
        if resp is not None:
            resp.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        resp = self.resp
        if resp is None:
            return
        status = self.parser.get_status_code()
        resp.status = status
        if status < 200:
            return  # informational (e.g. 100 Continue): the real response follows
        has_length = chunked = False
        for name, value in resp.raw_headers:
            low = name.lower()
            if low == b"content-type":
                if resp._content_type is None:
                    resp._content_type = value
            elif low == b"content-length":
                has_length = True
            elif low == b"transfer-encoding":
                chunked = chunked or b"chunked" in value.lower()
        resp._until_eof = status not in (204, 304) and not has_length and not chunked
        resp._head_done = True
        resp._wake()

    def on_body(self, body: bytes) -> None:
        resp = self.resp
        if resp is not None:
            resp._on_body(body)

    def on_message_complete(self) -> None:
        resp = self.resp
        if resp is None:
            return
        if resp.status < 200:
            # Drop the informational response's headers.
            resp.raw_headers = []
            resp._headers = None
            resp._content_type = None
            return
        # Not reusable if the server answered before taking the whole request (early
        # 413/400): our unsent body bytes would be read as the next request.
        keep = (
            self.parser.should_keep_alive()
            and not resp._closed
            and self.transport is not None
            and not self.transport.get_write_buffer_size()
        )
        self.resp = None
        resp._conn = None
        resp._eof = True
        resp._stop_timer()
        resp._wake()
        if keep:
            self.pool._release(self)
        else:
            self.discard()

    # -- helpers ----------------------------------------------------------------------------

    def send(self, resp: Response, payload: bytes) -> None:
        self.resp = resp
        assert self.transport is not None
        self.transport.write(payload)

    def pause(self) -> None:
        if not self.paused and self.transport is not None and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def _broken(self, exc: HTTP1Error) -> None:
        resp = self.resp
        self.resp = None
        if resp is not None:
            resp._fail(exc)
        self.discard()

    def discard(self) -> None:
        """Close the connection for good (it never returns to the pool)."""
        self.resp = None
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.abort()  # mid-response: no graceful close, drop the bytes
        self.pool._forget(self)


class HostPool:
    """Keep-alive connections to one ``host:port`` and the requests sent over them.

    Parameters
    ----------
    host, port : str, int
        The server.
    limit : int
        Most connections at once (in use + idle + being opened); more requests wait
        for one to be released.
    keepalive_s : float
        Idle connections older than this are closed.
    ssl_context : ssl.SSLContext, optional
        TLS for ``https`` servers.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        limit: int,
        keepalive_s: float = 30.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        if limit < 1:
            raise ValueError("limit must be >= 1")
        self.host = host
        self.port = port
        self.limit = limit
        self.keepalive_s = keepalive_s
        self.ssl_context = ssl_context
        host_header = f"[{host}]" if ":" in host else host
        self._fixed = f"Host: {host_header}:{port}\r\nConnection: keep-alive\r\n"
        self._heads: dict[str, bytes] = {}
        self._idle: collections.deque[_Connection] = collections.deque()
        self._conns: set[_Connection] = set()
        self._opening = 0
        self._waiters: collections.deque[asyncio.Future[_Connection | None]] = collections.deque()
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed = False
        # Bound at the first request: asyncio.get_running_loop() costs a getpid()
        # syscall on 3.11, and the pool's connections belong to that loop anyway.
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Connections opened so far (for tests and metrics).
        self.opened = 0

    @property
    def size(self) -> int:
        """Connections open or being opened."""
        return len(self._conns) + self._opening

    @property
    def idle(self) -> int:
        """Idle pooled connections."""
        return len(self._idle)

    async def request(
        self,
        path: str,
        body: bytes,
        headers: Iterable[tuple[str, str]] | bytes,
        *,
        deadline: float,
        connect_timeout_s: float,
        method: str = "POST",
    ) -> Response:
        """``POST`` ``body`` to ``path``; return once the response headers arrived.

        Parameters
        ----------
        path : str
            Request target (percent-encoded where needed).
        body : bytes
            Request body; ``Content-Length`` is set from it.
        headers : iterable of (str, str), or bytes
            Extra request headers (``Host``, ``Content-Length``, ``Connection`` and
            ``Transfer-Encoding`` are set by the client; callers' values are dropped).
            As bytes: header lines already encoded, each ending in CRLF, sent as they
            are; the caller guarantees none of those names and no CR/LF inside a
            name or value (true of headers relayed from an HTTP parser).
        deadline : float
            ``loop.time()`` by which the response headers must have arrived (waiting
            for a connection and connecting included).
        connect_timeout_s : float
            Most seconds for opening a new connection.
        method : str
            Another request method (``GET``: ``body`` empty; the stored-response routes).

        Returns
        -------
        Response
            With ``status`` and ``headers``; read the body with :meth:`Response.read`
            and always :meth:`Response.close` it.

        Raises
        ------
        ConnectError, ConnectTimeout, ResponseTimeout, ConnectionDropped, ProtocolError
        """
        if self._closed:
            raise ConnectionDropped("pool closed")
        payload = self._encode(path if method == "POST" else f"{method} {path}", body, headers)
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        retried = False
        while True:
            conn = await self._acquire(loop, deadline, connect_timeout_s, fresh=retried)
            resp = Response(conn, loop)
            conn.send(resp, payload)
            try:
                await resp._wait_head(deadline)
            except _StaleConnection:
                if retried:
                    raise
                retried = True
                continue
            except BaseException:
                resp.close()
                raise
            return resp

    def close(self) -> None:
        """Close every connection, idle or in use; fail waiters."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_exception(ConnectionDropped("pool closed"))
        for conn in list(self._conns):
            conn._broken(ConnectionDropped("pool closed"))
        self._idle.clear()

    # -- request encoding -------------------------------------------------------------------

    def _encode(self, path: str, body: bytes, headers: Iterable[tuple[str, str]] | bytes) -> bytes:
        # ``path`` is the target of a POST, or "METHOD target" (one cache for both).
        head = self._heads.get(path)
        if head is None:
            method, _, target = path.rpartition(" ")
            target = quote(target, safe=_PATH_SAFE)
            head = f"{method or 'POST'} {target} HTTP/1.1\r\n{self._fixed}".encode("ascii")
            if len(self._heads) < _MAX_CACHED_PATHS:
                self._heads[path] = head
        if isinstance(headers, bytes):
            return b"%b%bContent-Length: %d\r\n\r\n%b" % (head, headers, len(body), body)
        lines = [f"{k}: {v}\r\n" for k, v in headers if k.lower() not in _RESERVED]
        lines.append(f"Content-Length: {len(body)}\r\n\r\n")
        text = "".join(lines)
        # Header values come from clients: a CR or LF would split the request (request
        # smuggling). One count over the joined text instead of a check per header.
        if text.count("\n") != len(lines) + 1 or text.count("\r") != len(lines) + 1:
            raise ValueError("CR or LF in a request header")
        return head + text.encode("utf-8", "surrogateescape") + body

    # -- the pool ---------------------------------------------------------------------------

    async def _acquire(
        self,
        loop: asyncio.AbstractEventLoop,
        deadline: float,
        connect_timeout_s: float,
        *,
        fresh: bool,
    ) -> _Connection:
        idle = self._idle
        if idle:
            now = loop.time()
            while idle:
                conn = idle.pop()  # most recently used: least likely timed out by the peer
                if conn.closed or now - conn.idle_since > self.keepalive_s:
                    conn.discard()
                    continue
                if fresh:
                    # Retrying after a stale connection: its siblings are suspect, and
                    # the retry must not hit the same race. Recycle the slot.
                    conn.discard()
                    break
                return conn
        if self.size < self.limit:
            return await self._connect(loop, deadline, connect_timeout_s)
        waiter: asyncio.Future[_Connection | None] = loop.create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout_at(deadline):
                handed = await waiter
        except BaseException as exc:
            self._abandon(waiter)
            if isinstance(exc, TimeoutError):
                raise ResponseTimeout("no connection became free in time") from None
            raise
        if handed is not None:
            return handed
        # A slot was freed and reserved for us (counted in _opening by _slot_freed).
        self._opening -= 1
        return await self._connect(loop, deadline, connect_timeout_s)

    async def _connect(
        self, loop: asyncio.AbstractEventLoop, deadline: float, connect_timeout_s: float
    ) -> _Connection:
        self._opening += 1
        try:
            async with asyncio.timeout_at(min(loop.time() + connect_timeout_s, deadline)):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self),
                    self.host,
                    self.port,
                    ssl=self.ssl_context,
                    server_hostname=self.host if self.ssl_context is not None else None,
                )
        except BaseException as exc:
            self._opening -= 1
            self._slot_freed()
            if isinstance(exc, TimeoutError):
                raise ConnectTimeout("connect timed out") from None
            if isinstance(exc, OSError | ssl.SSLError):
                raise ConnectError(f"connect failed: {type(exc).__name__}") from None
            raise
        # The slot moves from "being opened" to "open" with no await in between.
        self._opening -= 1
        self._conns.add(conn)
        self.opened += 1
        if self._closed or conn.closed:
            conn.discard()
            raise ConnectionDropped("connection closed while opening")
        return conn

    def _abandon(self, waiter: asyncio.Future[_Connection | None]) -> None:
        """A waiter gave up (timeout, cancellation): pass on what it was handed, if any."""
        if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
            got = waiter.result()
            if got is None:
                self._opening -= 1  # the slot reserved for it
                self._slot_freed()
            else:
                self._release(got)
            return
        waiter.cancel()
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass

    def _release(self, conn: _Connection) -> None:
        """A connection finished a keep-alive response: hand it on or pool it."""
        if conn.paused:
            conn.resume()
        if self._closed or conn.closed:
            conn.discard()
            return
        conn.reused = True
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_result(conn)
                return
        loop = self._loop or asyncio.get_running_loop()
        conn.idle_since = loop.time()
        self._idle.append(conn)
        if self._sweeper is None:
            self._sweeper = loop.call_at(conn.idle_since + self.keepalive_s, self._sweep)

    def _forget(self, conn: _Connection) -> None:
        """A connection closed: free its slot (idempotent)."""
        if conn in self._conns:
            self._conns.discard(conn)
            try:
                self._idle.remove(conn)
            except ValueError:
                pass
            self._slot_freed()

    def _slot_freed(self) -> None:
        # Reserve the slot for the first live waiter; it opens a connection in it.
        if self._closed:
            return
        while self._waiters and self.size < self.limit:
            w = self._waiters.popleft()
            if not w.done():
                self._opening += 1
                w.set_result(None)
                return

    def _sweep(self) -> None:
        self._sweeper = None
        loop = self._loop or asyncio.get_running_loop()
        now = loop.time()
        idle = self._idle
        while idle and now - idle[0].idle_since >= self.keepalive_s - _TIMER_SLACK_S:
            idle.popleft().discard()
        if idle and not self._closed:
            self._sweeper = loop.call_at(idle[0].idle_since + self.keepalive_s, self._sweep)


def pool_for_url(url: str, *, limit: int = 1) -> tuple[HostPool, str]:
    """A :class:`HostPool` for the server of an ``http(s)://host[:port][/path]`` URL (TLS
    with the default context for ``https``) and the URL's path.

    Raises
    ------
    ValueError
        Not an http(s) URL with a host.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or parts.hostname is None:
        raise ValueError(f"expected http(s)://host[:port], got {url!r}")
    tls = parts.scheme == "https"
    pool = HostPool(
        parts.hostname,
        parts.port or (443 if tls else 80),
        limit=limit,
        ssl_context=ssl.create_default_context() if tls else None,
    )
    return pool, parts.path
