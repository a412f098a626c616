"""One generation of the Responses or Messages endpoints on an emulated engine.

The two APIs render their bodies to chat messages; from there a request is the same
sequence as a chat completion for the engine model (same prompt tokenization, prefix
cache, output-length draw, stepping and faults), only written in another wire format.
:func:`admit` does what :meth:`EmulatedEngine._generate` does up to the submit;
:meth:`Generation.batches` yields the output tokens as the model steps them.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from aiohttp import web

from fastroute.emulator.model import QueueFullError, Request, RequestTooLongError
from fastroute.emulator.output_text import OutputText
from fastroute.emulator.protocol import RequestError
from fastroute.hashing import key_hash
from fastroute.tokens import TokenizedPrompt, render_chat, tokenize_text

if TYPE_CHECKING:
    from fastroute.emulator.server import EmulatedEngine, TokenChannel

__all__ = [
    "Generation",
    "Sampling",
    "admit",
    "read_body",
    "tokenize_messages",
    "Prompt",
    "abort_connection",
    "Abort",
]

#: Builds an error response of the API: (status, message, param) -> response.
ErrorFactory = Callable[[int, str, "str | None"], web.Response]


class Abort(Exception):
    """The engine crashed mid-request (fault ``crash_after_tokens``): drop the connection."""


@dataclass(slots=True)
class Sampling:
    """What the output-length draw reads of a request (as the chat request's fields)."""

    max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False


async def read_body(
    engine: EmulatedEngine, request: web.Request, error: ErrorFactory
) -> bytes | web.Response:
    """The request body, or the error to answer first (unavailable, injected, too large)."""
    reason = engine._unavailable()
    if reason is not None:
        return error(503, reason, None)
    injected = engine.faults.draw_error()
    if injected is not None:
        return error(injected, f"injected fault: engine {engine.name} fails this request", None)
    limit = engine.spec.max_body_bytes
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return error(413, f"request body exceeds the limit of {limit} bytes", None)
    if len(body) > limit:
        return error(413, f"request body exceeds the limit of {limit} bytes", None)
    return body


@dataclass(frozen=True, slots=True)
class Prompt:
    """Chat messages as the engine sees them: the rendered text and its tokens."""

    text: str
    tokens: TokenizedPrompt


def tokenize_messages(messages: Sequence[Mapping[str, Any]], param: str) -> Prompt:
    """The engine's rendering and tokenization of chat ``messages`` (400 naming ``param``
    if invalid)."""
    try:
        text = render_chat(messages)
    except ValueError as exc:
        raise RequestError(400, str(exc), param) from None
    return Prompt(text, tokenize_text(text))


class Generation:
    """A submitted request: its output tokens as the engine steps them.

    Use :func:`admit`; always :meth:`close` (``finally``).
    """

    def __init__(self, engine: EmulatedEngine, mreq: Request, output: OutputText) -> None:
        self.engine = engine
        self.mreq = mreq
        self.output = output
        self.given = 0

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens."""
        return self.mreq.num_prompt_tokens

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens found in the prefix cache."""
        return self.mreq.num_cached_tokens

    @property
    def finish_reason(self) -> str:
        """``stop`` or ``length``."""
        return self.mreq.finish_reason

    def stream_error_due(self) -> bool:
        """The ``stream_error_after_tokens`` fault fires now."""
        return self.engine._stream_error_due(self.given)

    async def batches(self) -> AsyncIterator[list[str]]:
        """The texts of the tokens of each engine step (the end-of-sequence token of a
        ``stop`` is ``""`` when the engine's spec says so); raises :class:`Abort`."""
        engine, mreq = self.engine, self.mreq
        channel: TokenChannel = mreq.data
        while self.given < mreq.output_tokens:
            if engine._crash_due(self.given):
                raise Abort
            await channel.wait()
            if channel.aborted:
                raise Abort
            texts = []
            for _ in range(channel.take()):
                if engine._crash_due(self.given):
                    raise Abort
                texts.append(engine._token_text(self.output, self.given, mreq))
                self.given += 1
            if texts:
                yield texts

    def close(self) -> None:
        """Release the channel; cancel the sequence if it did not finish."""
        channel = self.mreq.data
        self.engine._channels.discard(channel)
        if not channel.finished:
            self.engine.model.cancel(self.mreq.request_id)


def admit(engine: EmulatedEngine, prompt: Prompt, sampling: Sampling, prefix: str) -> Generation:
    """Draw the output length and submit the request to the engine model; its output text
    is seeded by the rendered prompt, as a chat completion's (the same on every engine).

    Raises
    ------
    RequestError
        400 (too long for the model), 429 (the engine's queue is full).
    """
    from fastroute.emulator.server import TokenChannel  # the server imports this module

    tokens = prompt.tokens
    output_tokens, finish_reason = engine._output_length(sampling, tokens, False)
    request_id = f"{prefix}{uuid.uuid4().hex}"
    mreq = Request(
        request_id,
        tokens.num_tokens,
        tokens.block_hashes,
        output_tokens=output_tokens,
        finish_reason=finish_reason,
        data=TokenChannel(),
    )
    now = asyncio.get_running_loop().time()
    try:
        engine.model.submit(mreq, now)
    except QueueFullError as exc:
        raise RequestError(429, f"engine {engine.name} is overloaded: {exc}") from None
    except RequestTooLongError as exc:
        raise RequestError(400, str(exc)) from None
    engine._last_submit_s = now
    engine._wakeup.set()
    engine._channels.add(mreq.data)
    return Generation(engine, mreq, OutputText(key_hash(prompt.text) & 0xFFFFFFFF))


def abort_connection(request: web.Request) -> NoReturn:
    """Drop the client's connection (a crashed engine); never returns."""
    transport = request.transport
    if transport is not None:
        transport.abort()
    raise asyncio.CancelledError()
