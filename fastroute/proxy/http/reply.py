"""What the request path produces, independent of the HTTP server in front of it.

The request path (:mod:`fastroute.proxy.path.handler`) is served by the lean HTTP/1.1
server (:mod:`fastroute.proxy.http.server`). A handler returns a :class:`Reply`; a streamed
response goes through a :class:`Sink` the front end provides, and the handler then
returns a ``Reply`` with ``streamed=True`` (status only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Reply", "Sink", "Splice", "Headers"]

#: Response headers as (name, value) pairs, in order.
Headers = list[tuple[str, str]]


@dataclass(slots=True)
class Reply:
    """A whole response, or the status of one already streamed through a :class:`Sink`.

    Attributes
    ----------
    status : int
        HTTP status.
    headers : list of (str, str)
        Headers to send (the front end adds ``Content-Length``, ``x-request-id`` and
        ``x-fastroute-worker``).
    body : bytes
        The body (empty when ``streamed``).
    streamed : bool
        The response was already sent through the sink.
    raw_head : bytes
        More header lines, already encoded (each ``name: value\r\n``; relayed from an
        engine without decoding them), sent before ``headers``.
    """

    status: int
    headers: Headers
    body: bytes = b""
    streamed: bool = False
    raw_head: bytes = b""


class Sink(Protocol):
    """Where a streamed response is written (chunked transfer encoding on HTTP/1.1).

    ``write`` waits while the client is slow (back-pressure: nothing is buffered beyond
    the transport's high-water mark) and raises :class:`ConnectionResetError` once the
    client is gone.
    """

    async def start(self, status: int, headers: Headers, raw_head: bytes = b"") -> None:
        """Send the status line, ``raw_head`` (encoded lines) and ``headers``."""

    async def write(self, data: bytes) -> None:
        """Send one chunk of the body."""

    async def end(self) -> None:
        """Finish the body."""

    def splice(self) -> Splice | None:
        """The synchronous writer of a started body, or None when the front end has none.

        With it, the upstream connection's callback writes each chunk straight to the
        client (no coroutine wake-up per chunk); the body still ends with :meth:`end`.
        """


class Splice(Protocol):
    """Synchronous writes of a started chunked body (:meth:`Sink.splice`)."""

    def write_now(self, data: bytes, last: bool = False) -> bool:
        """Send one chunk now (``last``: and finish the body in the same write, after
        which :meth:`Sink.end` does nothing); False when the client's buffer is full
        (stop producing until the ``on_writable`` callback). A chunk for a client
        already gone is dropped (the request is being cancelled)."""

    def on_writable(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` when the client's buffer drained (None: stop calling)."""
