"""Token-true measurement of a relayed OpenAI SSE stream.

The proxy relays chunks as bytes; for TTFT, TBOT and output lengths it needs which
events carried output tokens and, when the engine said it, how many tokens it made.
An event carries a token when its delta has non-empty ``content``, ``reasoning`` (vLLM)
or ``reasoning_content`` (SGLang), or ``tool_calls``, or a completions choice has
non-empty ``text``. Not tokens: the chat role event (``"content":""``), llama.cpp's
progress events (``"content":null``), a final empty delta with ``finish_reason``, the
usage event (``"choices":[]``), an in-stream error (``data: {"error": ...}``) and
``[DONE]``. One engine event may carry several tokens (vLLM ``stream_interval``, or a
lagging reader), so the count of tokens is the engine's ``usage.completion_tokens``
when it sent usage, else one per token event (the best estimate).

The check is a few byte searches per read on compact JSON (what vLLM, SGLang,
llama.cpp and the emulator write); after the first token a read of content events
only costs two counts and one search. A stream whose first event is not compact
(``": "``) is checked event by event, decoding what the byte marks do not decide.

:class:`StreamMeter` also holds back a read's partial last event until its end
arrives (a client acts on whole events only), so each event is classified whole, and
it strips the usage event when the proxy asked for it on the client's behalf
(:func:`ask_for_usage`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from fastroute.proxy.path.engine_load import parse_usage

if TYPE_CHECKING:
    from fastroute.proxy.path.engine_load import _Usage

__all__ = ["DATA_PREFIX", "USAGE_MARK", "StreamMeter", "ask_for_usage"]

#: Start of every SSE data line.
DATA_PREFIX = b"data: "
#: What only the usage event of an OpenAI stream contains.
USAGE_MARK = b'"choices":[]'
_EVENT_END = b"\n\n"
_ERROR_START = b'data: {"error"'
_DONE = b"data: [DONE]"
_USAGE_KEY = b'"usage":{'
_CONTENT = b'"content":"'
_EMPTY_CONTENT = b'"content":""'
#: Bytes of the first read in which a non-compact engine's JSON shows a ``": ``.
_HEAD_BYTES = 80
_FINISH = b'"finish_reason":"'
#: A string field that carries a token when its value is not empty (compact JSON).
_TOKEN_STRINGS = (b'"content":"', b'"reasoning":"', b'"reasoning_content":"', b'"text":"')
_TOOL_CALLS = b'"tool_calls":['
#: A partial event longer than this is relayed without waiting for its end.
MAX_HELD_BYTES = 1 << 16
_INCLUDE_USAGE = b'"stream_options":{"include_usage":true},'


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[object] | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    text: str | None = None


class _Event(msgspec.Struct):
    choices: list[_Choice] | None = None


_event_decoder = msgspec.json.Decoder(_Event)


def _decoded_has_token(data: bytes) -> bool:
    try:
        event = _event_decoder.decode(data)
    except msgspec.DecodeError:
        return False
    for c in event.choices or ():
        if c.text:
            return True
        d = c.delta
        if d is not None and (d.content or d.reasoning or d.reasoning_content or d.tool_calls):
            return True
    return False


def _compact_tokens(chunk: bytes) -> int:
    """Token events among a compact-JSON chunk's events: the non-empty token fields (an
    event has one; a structural ``"content":"`` cannot occur inside a JSON string, where
    every quote is escaped)."""
    n = chunk.count(b'"content":"') - chunk.count(b'"content":""')
    if b'"reasoning' in chunk:
        n += chunk.count(b'"reasoning":"') - chunk.count(b'"reasoning":""')
        n += chunk.count(b'"reasoning_content":"') - chunk.count(b'"reasoning_content":""')
    if b'"text":"' in chunk:
        n += chunk.count(b'"text":"') - chunk.count(b'"text":""')
    if _TOOL_CALLS in chunk:
        n += chunk.count(_TOOL_CALLS) - chunk.count(b'"tool_calls":[]')
    return n


def has_token(event: bytes) -> bool:
    """Whether one SSE event (``data: {...}``, compact or not) carries an output token."""
    for mark in _TOKEN_STRINGS:
        i = event.find(mark)
        if i >= 0 and event[i + len(mark) : i + len(mark) + 1] != b'"':
            return True
    i = event.find(_TOOL_CALLS)
    if i >= 0 and event[i + len(_TOOL_CALLS) : i + len(_TOOL_CALLS) + 1] not in (b"]", b""):
        return True
    if b'": ' in event:  # not compact JSON: the byte marks may have missed a field
        return _decoded_has_token(event[len(DATA_PREFIX) :].strip())
    return False


class StreamMeter:
    """What a relayed SSE body carried, event by event (see the module docstring).

    Parameters
    ----------
    strip_usage : bool
        Drop the usage event from what is relayed (the proxy asked for it, the client
        did not).

    Attributes
    ----------
    token_events : int
        Events that carried output tokens.
    first_at, last_at : float
        When the first and the last of them arrived (NaN before the first).
    end_at : float
        When an event without a token but with a ``finish_reason`` arrived after them (an
        empty end-of-sequence delta; it counts in the engine's ``completion_tokens``).
    usage : _Usage or None
        The engine's last ``usage`` object.
    error : bytes or None
        The data of an in-stream error event.
    """

    __slots__ = (
        "strip_usage",
        "token_events",
        "first_at",
        "last_at",
        "end_at",
        "usage",
        "error",
        "held",
        "compact",
        "fast",
    )

    def __init__(self, strip_usage: bool = False) -> None:
        self.strip_usage = strip_usage
        self.token_events = 0
        self.first_at = self.last_at = self.end_at = float("nan")
        self.usage: _Usage | None = None
        self.error: bytes | None = None
        self.held = b""  # the partial event of the last read
        self.compact: bool | None = None  # compact JSON (decided on the first read)
        self.fast = False  # content-only reads take one count and one search

    @property
    def tokens(self) -> int:
        """Output tokens: the engine's ``completion_tokens`` if it said, else token events."""
        usage = self.usage
        if usage is not None and usage.completion_tokens is not None:
            return usage.completion_tokens
        return self.token_events

    @property
    def tbot_s(self) -> float | None:
        """Mean seconds between output tokens after the first (None under two tokens)."""
        n = self.tokens
        if n < 2 or self.token_events == 0:
            return None
        last_at = self.last_at
        if n != self.token_events and self.end_at > last_at:
            last_at = self.end_at  # the engine counted its empty end-of-sequence event
        if last_at <= self.first_at:
            return None
        return (last_at - self.first_at) / (n - 1)

    def feed(self, chunk: bytes, now: float, last: bool = False) -> bytes:
        """Measure a read at ``now``; the bytes to relay for it (``last``: the body
        ended with it, so nothing is held back)."""
        if self.held:
            chunk = self.held + chunk
            self.held = b""
        if (
            not last
            and not chunk.endswith(_EVENT_END)
            and not chunk.endswith(b"\r\n\r\n")
            and len(chunk) < MAX_HELD_BYTES
        ):
            cut = chunk.rfind(_EVENT_END) + 2
            if cut <= 1:
                self.held = chunk
                return b""
            self.held = chunk[cut:]
            chunk = chunk[:cut]
        if self.fast:  # after the first token: a read of content events only?
            n = chunk.count(_CONTENT)
            if n and n == chunk.count(DATA_PREFIX) and _EMPTY_CONTENT not in chunk:
                self.token_events += n
                self.last_at = now
                return chunk
        return self._classify(chunk, now)

    def _classify(self, chunk: bytes, now: float) -> bytes:
        """Measure a read of whole events of any kind; the bytes to relay for it."""
        if self.compact is None:  # the engine's JSON style, from its first event
            self.compact = b'": ' not in chunk[:_HEAD_BYTES]
        if self.compact:
            n = _compact_tokens(chunk)
        else:
            n = sum(has_token(e) for e in chunk.split(_EVENT_END) if e)
        if n:
            if self.token_events == 0:
                self.first_at = now
            self.token_events += n
            self.last_at = now
            # continuous_usage_stats: every event has usage, so no fast path
            self.fast = self.compact and _USAGE_KEY not in chunk
        elif self.token_events and _FINISH in chunk:
            self.end_at = now  # an empty final delta: the end-of-sequence token
        if _USAGE_KEY in chunk and self._read_usage(chunk):
            chunk = _without_usage(chunk)
        if _ERROR_START in chunk:
            start = chunk.index(_ERROR_START) + len(DATA_PREFIX)
            end = chunk.find(_EVENT_END, start)
            self.error = chunk[start : None if end < 0 else end].strip()
        return chunk

    def _read_usage(self, chunk: bytes) -> bool:
        """Take the ``usage`` of the chunk's events; whether to strip its usage event."""
        strip = False
        for line in chunk.split(b"\n"):
            if line.startswith(DATA_PREFIX) and _USAGE_KEY in line:
                usage = parse_usage(line[len(DATA_PREFIX) :])
                if usage is not None:
                    self.usage = usage
                    strip = strip or (self.strip_usage and USAGE_MARK in line)
        return strip

    def finish(self, now: float) -> bytes:
        """The held partial event, measured, at the body's end."""
        held, self.held = self.held, b""
        return self.feed(held, now, last=True) if held else b""


def _without_usage(chunk: bytes) -> bytes:
    """``chunk`` without its usage event (from its ``data: `` to its blank line)."""
    mark = chunk.index(USAGE_MARK)
    start = chunk.rfind(DATA_PREFIX, 0, mark)
    end = chunk.find(_EVENT_END, mark)
    return chunk[:start] + (b"" if end < 0 else chunk[end + 2 :])


def ask_for_usage(body: bytes, stream_options: object) -> bytes | None:
    """A streaming request ``body`` that also asks for the usage event, or None when it
    already does.

    ``stream_options`` is the body's parsed ``stream_options`` (``msgspec.UNSET`` when
    the key is absent: then one byte insert after the object's ``{`` is exact, as a
    streaming body has at least its ``stream`` key; else the body is re-encoded).
    """
    if stream_options is msgspec.UNSET:
        i = body.index(b"{") + 1
        return body[:i] + _INCLUDE_USAGE + body[i:]
    if isinstance(stream_options, dict) and stream_options.get("include_usage") is True:
        return None
    decoded = msgspec.json.decode(body)
    options = decoded.get("stream_options")
    options = dict(options) if isinstance(options, dict) else {}
    options["include_usage"] = True
    decoded["stream_options"] = options
    return msgspec.json.encode(decoded)
