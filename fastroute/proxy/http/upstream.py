"""Upstream I/O: keep-alive connection pools to the engines, timeouts, error kinds.

Backed by :mod:`fastroute.proxy.http.http1` (a lean HTTP/1.1 client on httptools; aiohttp's
client cost ~20 % of the proxy's CPU per request). One :class:`~fastroute.proxy.http.http1.HostPool`
per engine URL and worker: every engine gets its own set of keep-alive connections, at
most ``limits.max_concurrent_requests`` each, idle ones closed after
:data:`KEEPALIVE_S`. Requests carry ``Host: host:port``, ``Connection: keep-alive`` and
``Content-Length``. Timeouts are applied here, per attempt (``[timeouts]``), by lazily
re-armed timers rather than an ``asyncio.timeout()`` per wait:

``connect_timeout_s``
    TCP (and TLS) connect of a new connection;
``first_byte_timeout_s``
    sending the request until the response headers (engine queueing + prefill,
    waiting for a free pooled connection and connecting included), and after the
    headers until the first body chunk;
``idle_timeout_s``
    longest silence between two body chunks;
``total_timeout_s``
    the whole attempt: every wait is capped by what is left of it.

Failures become :class:`UpstreamError` with the
:class:`~fastroute.guards.outlier.Outcome` the outlier detector records and the
status the client gets (502 for connect errors, disconnects and 5xx, 504 for
timeouts; style.md §3.1).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Iterable
from urllib.parse import urlsplit

from fastroute.config import Config, EngineConfig
from fastroute.guards.outlier import Outcome
from fastroute.proxy.http import http1

__all__ = ["UpstreamError", "UpstreamPool", "HOP_BY_HOP", "MAX_ERROR_BODY_BYTES"]

#: Hop-by-hop headers (RFC 9110 §7.6.1): never forwarded in either direction.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
#: Most bytes of a non-streamed upstream body read into memory (larger is an error).
MAX_ERROR_BODY_BYTES = 64 * 1024 * 1024
#: Idle pooled connections are closed after this many seconds (as aiohttp's pool did).
KEEPALIVE_S = 30.0


class UpstreamError(Exception):
    """An attempt failed before a usable response, or a stream broke.

    Attributes
    ----------
    outcome : Outcome
        What the outlier detector records.
    status : int
        What the client gets if this is the last attempt (502 or 504).
    message : str
        Client-safe description (engine name, never its address).
    """

    def __init__(self, outcome: Outcome, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.message = message
        self.status = 504 if outcome is Outcome.TIMEOUT else 502

    @property
    def code(self) -> str:
        """The OpenAI ``error.code``."""
        return "upstream_timeout" if self.outcome is Outcome.TIMEOUT else "upstream_error"


def _classify(exc: http1.HTTP1Error, engine: str, stage: str) -> UpstreamError:
    if isinstance(exc, TimeoutError):
        return UpstreamError(Outcome.TIMEOUT, f"engine {engine} timed out {stage}")
    if isinstance(exc, http1.ConnectError):
        return UpstreamError(Outcome.CONNECT_ERROR, f"cannot connect to engine {engine}")
    return UpstreamError(
        Outcome.CONNECT_ERROR, f"engine {engine} failed {stage}: {type(exc).__name__}"
    )


class UpstreamPool:
    """The keep-alive pools and the per-attempt I/O primitives.

    Parameters
    ----------
    config : Config
        Uses ``timeouts`` and ``limits``.
    """

    def __init__(self, config: Config) -> None:
        self.timeouts = config.timeouts
        self._limit = config.limits.max_concurrent_requests
        # Engine URL -> pool. Bounded by the engines of this config generation (a
        # reload builds a new UpstreamPool and closes this one).
        self._pools: dict[str, http1.HostPool] = {}
        self._ssl: ssl.SSLContext | None = None
        # Looked up once: asyncio.get_running_loop() costs a getpid() syscall on 3.11.
        self._loop: asyncio.AbstractEventLoop | None = None

    def _pool(self, engine: EngineConfig) -> http1.HostPool:
        url = engine.url
        parts = urlsplit(url)
        if parts.hostname is None or parts.port is None:
            raise UpstreamError(Outcome.CONNECT_ERROR, f"cannot connect to engine {engine.name}")
        ssl_context = None
        if parts.scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            ssl_context = self._ssl
        pool = http1.HostPool(
            parts.hostname,
            parts.port,
            limit=self._limit,
            keepalive_s=KEEPALIVE_S,
            ssl_context=ssl_context,
        )
        self._pools[url] = pool
        return pool

    async def close(self) -> None:
        """Close every connection, pooled or in use."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    async def open(
        self,
        engine: EngineConfig,
        path: str,
        body: bytes,
        headers: Iterable[tuple[str, str]] | bytes,
        deadline: float,
        method: str = "POST",
    ) -> http1.Response:
        """Send ``body`` to ``engine`` and wait for the response headers.

        Parameters
        ----------
        engine : EngineConfig
            The engine; its pool is created on first use.
        path : str
            Request path (``/v1/...``).
        body : bytes
            Request body (``POST``).
        headers : iterable of (str, str), or bytes
            Headers to forward, hop-by-hop ones already removed by the caller (bytes:
            encoded lines, see ``http1.HostPool.request``).
        deadline : float
            ``loop.time()`` by which the whole attempt must be over.
        method : str
            Another request method (``GET``, with an empty ``body``).

        Returns
        -------
        http1.Response
            ``status``, ``headers``, ``content_type``; the caller must ``close()`` it.

        Raises
        ------
        UpstreamError
            Connect error, disconnect or timeout before the headers.
        """
        pool = self._pools.get(engine.url) or self._pool(engine)
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        header_deadline = min(loop.time() + self.timeouts.first_byte_timeout_s, deadline)
        try:
            return await pool.request(
                path,
                body,
                headers,
                deadline=header_deadline,
                connect_timeout_s=self.timeouts.connect_timeout_s,
                method=method,
            )
        except http1.HTTP1Error as exc:
            raise _classify(exc, engine.name, "before responding") from None

    async def read_chunk(
        self, resp: http1.Response, engine: str, wait_s: float, deadline: float
    ) -> bytes:
        """The body bytes that arrived so far, waiting for some (``b""`` at the end).

        Parameters
        ----------
        resp : http1.Response
            From :meth:`open`.
        engine : str
            Engine name, for error messages.
        wait_s : float
            Most seconds to wait for a byte (first-byte or idle timeout).
        deadline : float
            ``loop.time()`` by which the whole attempt must be over (caps ``wait_s``).

        Raises
        ------
        UpstreamError
            The connection broke, or nothing arrived within ``wait_s`` (capped by
            ``deadline``).
        """
        try:
            return await resp.read(wait_s, deadline)
        except http1.HTTP1Error as exc:
            raise _classify(exc, engine, "mid-response") from None

    async def wait_end(self, resp: http1.Response, engine: str, deadline: float) -> None:
        """Wait for the end of a body relayed by :meth:`http1.Response.relay`.

        Each chunk must follow the previous one within ``idle_timeout_s``.

        Raises
        ------
        UpstreamError
            As :meth:`read_chunk`.
        """
        try:
            await resp.wait_end(self.timeouts.idle_timeout_s, deadline)
        except http1.HTTP1Error as exc:
            raise _classify(exc, engine, "mid-response") from None

    def complete_body(self, resp: http1.Response, engine: str) -> bytes | None:
        """The whole body if it already arrived (no wait), else None: then use
        :meth:`read_body`.

        Raises
        ------
        UpstreamError
            ``HTTP_5XX`` for a body over :data:`MAX_ERROR_BODY_BYTES`, as :meth:`read_body`.
        """
        data = resp.complete_body()
        if data is not None and len(data) > MAX_ERROR_BODY_BYTES:
            raise UpstreamError(
                Outcome.HTTP_5XX, f"engine {engine} sent a body over {MAX_ERROR_BODY_BYTES} bytes"
            )
        return data

    async def read_body(self, resp: http1.Response, engine: str, deadline: float) -> bytes:
        """The whole body of a non-streamed response (each chunk within the idle timeout).

        Raises
        ------
        UpstreamError
            As :meth:`read_chunk`; ``HTTP_5XX`` for a body over
            :data:`MAX_ERROR_BODY_BYTES`.
        """
        parts: list[bytes] = []
        size = 0
        first = True
        while True:
            wait_s = self.timeouts.first_byte_timeout_s if first else self.timeouts.idle_timeout_s
            chunk = await self.read_chunk(resp, engine, wait_s, deadline)
            if not chunk:
                return parts[0] if len(parts) == 1 else b"".join(parts)
            first = False
            size += len(chunk)
            if size > MAX_ERROR_BODY_BYTES:
                raise UpstreamError(
                    Outcome.HTTP_5XX,
                    f"engine {engine} sent a body over {MAX_ERROR_BODY_BYTES} bytes",
                )
            parts.append(chunk)
