"""Reading a whole HTTP response body, bounded.

``aiohttp``'s ``StreamReader.read(n)`` returns *up to* ``n`` bytes: whatever has arrived, not the
whole body. A ``/metrics`` page, a weight table or a model list that arrives in several TCP
segments would be cut at the first one (seen on a loaded machine: a real vLLM's ``/metrics``
parsed as ``…_bucke``). :func:`read_bounded` reads until the end of the body or one byte past
the bound, so callers can tell "too large" from "complete".
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["read_bounded"]


class _Stream(Protocol):
    async def read(self, n: int = -1) -> bytes: ...


async def read_bounded(stream: _Stream, limit: int) -> bytes:
    """The body of ``stream`` up to ``limit + 1`` bytes (more than ``limit``: too large).

    Parameters
    ----------
    stream : aiohttp.StreamReader or alike
        ``resp.content``.
    limit : int
        The largest body the caller accepts, bytes (≥ 0).
    """
    parts: list[bytes] = []
    size = 0
    while size <= limit:
        chunk = await stream.read(limit + 1 - size)
        if not chunk:
            break
        parts.append(chunk)
        size += len(chunk)
    return b"".join(parts)
