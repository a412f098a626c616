"""Token-true measurement of the Responses and the Anthropic Messages SSE streams.

Both dialects name each event (``event: <type>`` then ``data: {...}``), so the meters
here read the type of every event instead of searching the bytes for token fields as
the chat meter (:class:`~fastroute.proxy.path.sse.StreamMeter`) does; they keep its
interface (attributes, :meth:`feed`, :meth:`finish`, ``tokens``, ``tbot_s``) and its
holding back of a partial last event.

=======================  ==================================  ================================
                         Responses (``/v1/responses``)       Messages (``/v1/messages``)
=======================  ==================================  ================================
carries tokens           ``response.*.delta`` with a         ``content_block_delta`` with a
                         non-empty ``delta`` (output text,   non-empty ``text``, ``thinking``
                         reasoning, function arguments)      or ``partial_json``
usage                    ``response.completed`` (or          ``message_delta``'s ``usage``
                         ``.incomplete``/``.failed``):       (``output_tokens``), after
                         ``response.usage.output_tokens``    ``message_start``'s input tokens
end of the output        ``response.output_text.done``       ``content_block_stop``
in-stream error          ``error``, ``response.failed``      ``error``
=======================  ==================================  ================================

The event type is taken from the ``event:`` line, else from the data's ``type``. An
OpenAI-shaped error event (``data: {"error": ...}``) counts as an error in either
dialect. Engines always send usage on these streams, so nothing is stripped.
"""

from __future__ import annotations

from typing import Any

import msgspec

from fastroute.proxy.path.engine_load import _Usage
from fastroute.proxy.path.sse import StreamMeter

__all__ = ["ResponsesStreamMeter", "AnthropicStreamMeter", "event_parts"]

_EVENT_END = b"\n\n"
_EVENT_LINE = b"event:"
_DATA_LINE = b"data:"
_TYPE_MARK = b'"type":"'
_ERROR_DATA = b'{"error"'


def event_parts(event: bytes) -> tuple[bytes, bytes]:
    """The type and the data of one SSE event (``b""`` for what it lacks)."""
    name = data = b""
    for line in event.split(b"\n"):
        line = line.rstrip(b"\r")
        if line.startswith(_EVENT_LINE):
            name = line[len(_EVENT_LINE) :].strip()
        elif line.startswith(_DATA_LINE):
            data = line[len(_DATA_LINE) :].strip()
    if not name and data.startswith(b"{"):
        i = data.find(_TYPE_MARK)
        if i >= 0:
            start = i + len(_TYPE_MARK)
            name = data[start : data.find(b'"', start)]
    return name, data


class _DialectMeter(StreamMeter):
    """The event loop the two dialect meters share; subclasses say what an event means."""

    __slots__ = ()

    def _classify(self, chunk: bytes, now: float) -> bytes:
        """Measure a read of whole events; the bytes to relay (unchanged)."""
        for event in chunk.split(_EVENT_END):
            if event.strip():
                name, data = event_parts(event)
                if data.startswith(_ERROR_DATA):
                    self.error = data
                else:
                    self._event(name, data, now)
        return chunk

    def _token(self, now: float) -> None:
        if self.token_events == 0:
            self.first_at = now
        self.token_events += 1
        self.last_at = now

    def _event(self, name: bytes, data: bytes, now: float) -> None:
        raise NotImplementedError


class _ResponseUsage(msgspec.Struct):
    input_tokens: int | None = None
    output_tokens: int | None = None


class _ResponseBody(msgspec.Struct):
    id: str | None = None
    usage: _ResponseUsage | None = None


class _ResponseEvent(msgspec.Struct):
    response: _ResponseBody | None = None


class _Delta(msgspec.Struct):
    delta: Any = None


_response_event = msgspec.json.Decoder(_ResponseEvent)
_delta_event = msgspec.json.Decoder(_Delta)
_FINAL_RESPONSE_EVENTS = (b"response.completed", b"response.incomplete", b"response.failed")


def _decode(decoder: msgspec.json.Decoder, data: bytes) -> Any:
    try:
        return decoder.decode(data)
    except msgspec.DecodeError:
        return None


class ResponsesStreamMeter(_DialectMeter):
    """What a relayed Responses stream carried (see the module docstring).

    Attributes
    ----------
    response_id : str or None
        The id of the response, from ``response.created`` (what the engine stores).
    """

    __slots__ = ("response_id",)

    def __init__(self, strip_usage: bool = False) -> None:
        super().__init__(strip_usage)
        self.response_id: str | None = None

    def _event(self, name: bytes, data: bytes, now: float) -> None:
        if name.endswith(b".delta"):
            event = _decode(_delta_event, data)
            if event is not None and event.delta:
                self._token(now)
        elif name == b"response.output_text.done" and self.token_events:
            self.end_at = now
        elif name == b"response.created" or name in _FINAL_RESPONSE_EVENTS:
            event = _decode(_response_event, data)
            body = event.response if event is not None else None
            if body is not None:
                self.response_id = self.response_id or body.id
                if body.usage is not None:
                    u = body.usage
                    self.usage = _Usage(
                        prompt_tokens=u.input_tokens, completion_tokens=u.output_tokens
                    )
            if name == b"response.failed":
                self.error = data
        elif name == b"error":
            self.error = data


class _AnthropicUsage(msgspec.Struct):
    input_tokens: int | None = None
    output_tokens: int | None = None


class _AnthropicMessage(msgspec.Struct):
    usage: _AnthropicUsage | None = None


class _AnthropicDelta(msgspec.Struct):
    text: str | None = None
    thinking: str | None = None
    partial_json: str | None = None


class _AnthropicEvent(msgspec.Struct):
    delta: _AnthropicDelta | None = None
    usage: _AnthropicUsage | None = None
    message: _AnthropicMessage | None = None


_anthropic_event = msgspec.json.Decoder(_AnthropicEvent)


class AnthropicStreamMeter(_DialectMeter):
    """What a relayed Anthropic Messages stream carried (see the module docstring)."""

    __slots__ = ("input_tokens",)

    def __init__(self, strip_usage: bool = False) -> None:
        super().__init__(strip_usage)
        self.input_tokens: int | None = None

    def _event(self, name: bytes, data: bytes, now: float) -> None:
        if name == b"content_block_delta":
            event = _decode(_anthropic_event, data)
            d = event.delta if event is not None else None
            if d is not None and (d.text or d.thinking or d.partial_json):
                self._token(now)
        elif name == b"content_block_stop" and self.token_events:
            self.end_at = now
        elif name in (b"message_start", b"message_delta"):
            event = _decode(_anthropic_event, data)
            if event is None:
                return
            usage = event.usage or (event.message.usage if event.message else None)
            if usage is None:
                return
            if usage.input_tokens:
                self.input_tokens = usage.input_tokens
            if name == b"message_delta":
                self.usage = _Usage(
                    prompt_tokens=self.input_tokens, completion_tokens=usage.output_tokens
                )
        elif name == b"error":
            self.error = data
