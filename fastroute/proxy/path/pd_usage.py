"""The client-visible ``cached_tokens`` of a P/D request: the prefill engine's.

A decode engine counts the prompt it received from the prefill engine as cached, so
its ``usage.prompt_tokens_details.cached_tokens`` is about the whole prompt whatever
the prefix cache did. The prefill engine's answer says how much of the prompt was
really served from cache; the decode stage's usage (a JSON body, or every ``data:``
event with ``"usage"`` of a stream) gets that number instead, and none when the
prefill engine reported none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from fastroute.proxy.http.reply import Headers, Sink, Splice

__all__ = [
    "prefill_cached_tokens",
    "stream_cached_tokens",
    "with_prefill_cached",
    "CachedTokensSink",
]

_EVENT_END = b"\n\n"
_DATA = b"data: "
_USAGE = b'"usage"'


def prefill_cached_tokens(prefill_response: bytes) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a prefill engine's JSON answer
    (None when absent or not an integer)."""
    try:
        body = msgspec.json.decode(prefill_response)
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    except (msgspec.DecodeError, KeyError, TypeError):
        return None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


def stream_cached_tokens(events: bytes) -> int | None:
    """The ``cached_tokens`` of a prefill engine's streamed answer: its last ``data:``
    event with a usage object (None when no event has one)."""
    for event in reversed(events.split(_EVENT_END)):
        if event.startswith(_DATA) and _USAGE in event:
            return prefill_cached_tokens(event[len(_DATA) :])
    return None


def _set_cached(usage: Any, cached: int | None) -> bool:
    """Put ``cached`` into a ``usage`` object (remove the decode engine's count when
    None); whether anything changed."""
    if not isinstance(usage, dict):
        return False
    details = usage.get("prompt_tokens_details")
    if cached is not None:
        if isinstance(details, dict):
            details["cached_tokens"] = cached
        else:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return True
    if not isinstance(details, dict) or "cached_tokens" not in details:
        return False
    del details["cached_tokens"]
    if not details:
        usage["prompt_tokens_details"] = None
    return True


def with_prefill_cached(data: bytes, cached: int | None) -> bytes:
    """A decode engine's JSON answer (or one SSE event's JSON) with the prefill's
    ``cached_tokens``; ``data`` itself when it has no usage object."""
    try:
        body = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return data
    if not isinstance(body, dict) or not _set_cached(body.get("usage"), cached):
        return data
    return msgspec.json.encode(body)


def _rewrite_events(events: bytes, cached: int | None) -> bytes:
    """Whole SSE events (each ending with a blank line) with usage rewritten."""
    if _USAGE not in events:
        return events
    out = []
    for event in events.split(_EVENT_END)[:-1]:
        if event.startswith(_DATA) and _USAGE in event:
            event = _DATA + with_prefill_cached(event[len(_DATA) :], cached)
        out.append(event + _EVENT_END)
    return b"".join(out)


class CachedTokensSink:
    """The client's sink for a P/D decode stage: usage events carry the prefill's
    ``cached_tokens``.

    Events are passed on whole: the tail of a chunk after its last blank line waits
    for the next chunk (or the end). The front end's splice, if any, is kept (this
    object is the splice then).

    Parameters
    ----------
    sink : Sink
        The client's sink.
    cached : int or None
        The prefill engine's ``cached_tokens`` (may be set later, before the usage event).

    Attributes
    ----------
    started : bool
        The client's response has begun (no other engine may answer it now).
    """

    def __init__(self, sink: Sink, cached: int | None) -> None:
        self.sink = sink
        self.cached = cached
        self.started = False
        self._tail = b""
        self._splice: Splice | None = None

    def _feed(self, data: bytes, last: bool) -> bytes:
        data = self._tail + data
        cut = len(data) if last else data.rfind(_EVENT_END) + len(_EVENT_END)
        if cut < len(_EVENT_END) and not last:  # no event end in it yet
            self._tail = data
            return b""
        whole, self._tail = data[:cut], data[cut:]
        if not whole.endswith(_EVENT_END):  # the end of a body without a final blank line
            head, sep, rest = whole.rpartition(_EVENT_END)
            return _rewrite_events(head + sep, self.cached) + rest
        return _rewrite_events(whole, self.cached)

    async def start(self, status: int, headers: Headers, raw_head: bytes = b"") -> None:
        """Start the client's response."""
        self.started = True
        await self.sink.start(status, headers, raw_head)

    async def write(self, data: bytes) -> None:
        """Pass on the whole events of ``data`` (with what was left of the last chunk)."""
        out = self._feed(data, last=False)
        if out:
            await self.sink.write(out)

    async def end(self) -> None:
        """Pass on what is left, then end the client's body."""
        out = self._feed(b"", last=True)
        if out:
            await self.sink.write(out)
        await self.sink.end()

    def splice(self) -> CachedTokensSink | None:
        """This object as the splice, when the client's sink has one."""
        self._splice = self.sink.splice()
        return self if self._splice is not None else None

    def write_now(self, data: bytes, last: bool = False) -> bool:
        """Pass on the whole events of ``data`` now (see :meth:`Splice.write_now`)."""
        assert self._splice is not None
        out = self._feed(data, last)
        if not out:
            return True  # nothing to write; with ``last``, :meth:`end` ends the body
        return self._splice.write_now(out, last)

    def on_writable(self, callback: Callable[[], None] | None) -> None:
        """Forward the client's drain callback."""
        assert self._splice is not None
        self._splice.on_writable(callback)
