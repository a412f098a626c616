"""Upstream I/O: one keep-alive connection pool to the engines, timeouts, error kinds.

One :class:`aiohttp.ClientSession` per worker over one
:class:`aiohttp.TCPConnector`, whose pools are per (host, port): every engine gets
its own set of keep-alive connections, at most ``limits.max_concurrent_requests``
each. Timeouts are applied here, per attempt (``[timeouts]``):

``connect_timeout_s``
    TCP connect (``ClientTimeout.sock_connect``);
``first_byte_timeout_s``
    sending the request until the response headers (engine queueing + prefill),
    and after the headers until the first body chunk;
``idle_timeout_s``
    longest silence between two body chunks;
``total_timeout_s``
    the whole attempt: every wait is capped by what is left of it.

Failures become :class:`UpstreamError` with the
:class:`~fastroute.proxy.outlier.Outcome` the outlier detector records and the
status the client gets (502 for connect errors, disconnects and 5xx, 504 for
timeouts; style.md §3.1).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import aiohttp
from multidict import CIMultiDict

from fastroute.config import Config, EngineConfig
from fastroute.proxy.outlier import Outcome

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


def _classify(exc: BaseException, engine: str, stage: str) -> UpstreamError:
    if isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError):
        return UpstreamError(Outcome.TIMEOUT, f"engine {engine} timed out {stage}")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return UpstreamError(Outcome.CONNECT_ERROR, f"cannot connect to engine {engine}")
    return UpstreamError(
        Outcome.CONNECT_ERROR, f"engine {engine} failed {stage}: {type(exc).__name__}"
    )


class UpstreamPool:
    """The keep-alive pool and the per-attempt I/O primitives.

    Parameters
    ----------
    config : Config
        Uses ``timeouts`` and ``limits``.
    """

    def __init__(self, config: Config) -> None:
        self.timeouts = config.timeouts
        limit = config.limits.max_concurrent_requests
        self._connector = aiohttp.TCPConnector(
            limit=limit, limit_per_host=limit, keepalive_timeout=30.0
        )
        self.session = aiohttp.ClientSession(
            connector=self._connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.timeouts.connect_timeout_s),
            skip_auto_headers=("User-Agent",),
            raise_for_status=False,
        )

    async def close(self) -> None:
        """Close every pooled connection."""
        await self.session.close()

    async def open(
        self,
        engine: EngineConfig,
        path: str,
        body: bytes,
        headers: Mapping[str, str] | CIMultiDict[str],
        deadline: float,
    ) -> aiohttp.ClientResponse:
        """Send ``body`` to ``engine`` and wait for the response headers.

        Raises
        ------
        UpstreamError
            Connect error, disconnect or timeout before the headers.
        """
        loop = asyncio.get_running_loop()
        wait_s = min(self.timeouts.first_byte_timeout_s, deadline - loop.time())
        try:
            async with asyncio.timeout(max(wait_s, 0.0)):
                return await self.session.post(engine.url + path, data=body, headers=headers)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise _classify(exc, engine.name, "before responding") from None

    async def read_chunk(
        self, resp: aiohttp.ClientResponse, engine: str, wait_s: float, deadline: float
    ) -> bytes:
        """The next body chunk as it arrives (``b""`` at the end of the body).

        Raises
        ------
        UpstreamError
            The connection broke, or nothing arrived within ``wait_s`` (capped by
            ``deadline``).
        """
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(max(min(wait_s, deadline - loop.time()), 0.0)):
                return await resp.content.readany()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise _classify(exc, engine, "mid-response") from None

    async def read_body(self, resp: aiohttp.ClientResponse, engine: str, deadline: float) -> bytes:
        """The whole body of a non-streamed response (each chunk within the idle timeout)."""
        parts: list[bytes] = []
        size = 0
        first = True
        while True:
            wait_s = self.timeouts.first_byte_timeout_s if first else self.timeouts.idle_timeout_s
            chunk = await self.read_chunk(resp, engine, wait_s, deadline)
            if not chunk:
                return b"".join(parts)
            first = False
            size += len(chunk)
            if size > MAX_ERROR_BODY_BYTES:
                raise UpstreamError(
                    Outcome.HTTP_5XX,
                    f"engine {engine} sent a body over {MAX_ERROR_BODY_BYTES} bytes",
                )
            parts.append(chunk)
