"""The emulated engine's Anthropic Messages API, shaped like vLLM 0.32's.

``POST /v1/messages``
    ``system`` + ``messages`` rendered to chat messages (text blocks joined). Not
    streamed: the ``message`` object (``content`` one text block, ``stop_reason``
    ``end_turn`` or ``max_tokens``, ``usage``). Streamed: ``event: <type>`` +
    ``data: {...}`` for ``message_start`` (usage with the input tokens),
    ``content_block_start``, ``content_block_delta`` (one ``text_delta`` per engine
    step), ``content_block_stop``, ``message_delta`` (stop reason, usage with the output
    tokens) and ``message_stop``; an engine fault mid-stream is an ``event: error``.
``POST /v1/messages/count_tokens``
    ``{"input_tokens", "context_management": {"original_input_tokens"}}``.

Errors are vLLM's: ``{"type": "error", "error": {"type", "message"}}``, the type the
name of vLLM's error class for the status (``BadRequestError``, ``NotFoundError``...).
``max_tokens`` is required and at least 1, as Anthropic's API has it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from fastroute.emulator.api_generation import (
    Abort,
    Generation,
    Sampling,
    abort_connection,
    admit,
    read_body,
    tokenize_messages,
)
from fastroute.emulator.protocol import ERROR_TYPES, RequestError

if TYPE_CHECKING:
    from fastroute.emulator.server import EmulatedEngine

__all__ = ["MessagesAPI", "anthropic_messages"]

_STREAM_ERROR_MESSAGE = (
    "EngineCore encountered an issue. See stack trace (above) for the root cause."
)
_STOP_REASON = {"stop": "end_turn", "length": "max_tokens"}
_encode = msgspec.json.encode


class _MessagesBody(msgspec.Struct):
    model: str | None = None
    messages: list[dict[str, Any]] | msgspec.UnsetType = msgspec.UNSET
    system: str | list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    stream: bool | None = False


_decoder = msgspec.json.Decoder(_MessagesBody)


def _blocks_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(
        str(b.get("text") or "") for b in content if isinstance(b, dict) and b.get("type") == "text"
    )


def anthropic_messages(body: _MessagesBody) -> list[dict[str, Any]]:
    """The chat messages of a body's ``system`` and ``messages``."""
    messages: list[dict[str, Any]] = []
    system = _blocks_text(body.system)
    if system:
        messages.append({"role": "system", "content": system})
    assert not isinstance(body.messages, msgspec.UnsetType)
    for m in body.messages:
        messages.append({"role": m.get("role"), "content": _blocks_text(m.get("content"))})
    return messages


def _error(engine: EmulatedEngine, status: int, message: str, param: str | None) -> web.Response:
    etype = ERROR_TYPES.get(status, "InternalServerError")
    body = {"type": "error", "error": {"type": etype, "message": message}}
    return web.json_response(body, status=status, headers={"x-fastroute-engine": engine.name})


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: %b\ndata: %b\n\n" % (kind.encode(), _encode({"type": kind, **data}))


class MessagesAPI:
    """The Messages routes of one emulated engine (see the module docstring)."""

    def __init__(self, engine: EmulatedEngine) -> None:
        self.engine = engine

    def install(self, app: web.Application) -> None:
        """Add the routes to the engine's app."""
        app.router.add_post("/v1/messages", self.create)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)

    def _err(self, status: int, message: str, param: str | None) -> web.Response:
        return _error(self.engine, status, message, param)

    def _parse(self, body: bytes, need_max_tokens: bool) -> _MessagesBody:
        try:
            parsed = _decoder.decode(body)
        except msgspec.DecodeError as exc:
            raise RequestError(400, f"invalid request: {exc}") from None
        if isinstance(parsed.messages, msgspec.UnsetType):
            raise RequestError(400, "Field required: messages", "messages")
        if need_max_tokens and parsed.max_tokens is None:
            raise RequestError(400, "Field required: max_tokens", "max_tokens")
        if parsed.max_tokens is not None and parsed.max_tokens < 1:
            raise RequestError(
                400, f"max_tokens must be at least 1, got {parsed.max_tokens}.", "max_tokens"
            )
        if parsed.model is not None and parsed.model != self.engine.spec.model_name:
            raise RequestError(404, f"The model `{parsed.model}` does not exist.", "model")
        return parsed

    async def count_tokens(self, request: web.Request) -> web.Response:
        """``POST /v1/messages/count_tokens``."""
        body = await read_body(self.engine, request, self._err)
        if isinstance(body, web.Response):
            return body
        try:
            parsed = self._parse(body, need_max_tokens=False)
            prompt = tokenize_messages(anthropic_messages(parsed), "messages")
        except RequestError as exc:
            return self._err(exc.status, exc.message, exc.param)
        n = prompt.tokens.num_tokens
        return web.json_response(
            {"input_tokens": n, "context_management": {"original_input_tokens": n}},
            headers={"x-fastroute-engine": self.engine.name},
        )

    async def create(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/messages``."""
        engine = self.engine
        body = await read_body(engine, request, self._err)
        if isinstance(body, web.Response):
            return body
        try:
            parsed = self._parse(body, need_max_tokens=True)
            prompt = tokenize_messages(anthropic_messages(parsed), "messages")
            if engine.faults.state.hang:  # before the submit, as for chat
                return await engine._hang(request)
            gen = admit(engine, prompt, Sampling(max_tokens=parsed.max_tokens), "msg_")
        except RequestError as exc:
            return self._err(exc.status, exc.message, exc.param)
        try:
            if parsed.stream:
                return await self._stream(request, gen)
            return await self._whole(gen)
        except Abort:
            abort_connection(request)
        finally:
            gen.close()

    def _message(self, gen: Generation, text: str | None) -> dict[str, Any]:
        done = text is not None
        return {
            "id": gen.mreq.request_id,
            "type": "message",
            "role": "assistant",
            "content": [{"type": "text", "text": text}] if done else [],
            "model": self.engine.spec.model_name,
            "stop_reason": _STOP_REASON[gen.finish_reason] if done else None,
            "stop_sequence": None,
            "usage": {"input_tokens": gen.prompt_tokens, "output_tokens": gen.given},
        }

    async def _whole(self, gen: Generation) -> web.Response:
        texts: list[str] = []
        async for batch in gen.batches():
            if gen.stream_error_due():
                return self._err(500, _STREAM_ERROR_MESSAGE, None)
            texts.extend(batch)
        return web.json_response(
            self._message(gen, "".join(texts)), headers={"x-fastroute-engine": self.engine.name}
        )

    async def _stream(self, request: web.Request, gen: Generation) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "x-fastroute-engine": self.engine.name,
            }
        )
        await resp.prepare(request)
        await resp.write(_event("message_start", {"message": self._message(gen, None)}))
        started = False
        async for batch in gen.batches():
            if gen.stream_error_due():
                error = {"type": "internal_error", "message": _STREAM_ERROR_MESSAGE}
                await resp.write(_event("error", {"error": error}))
                await resp.write_eof()
                return resp
            out = b""
            if not started:
                started = True
                block = {"type": "text", "text": ""}
                out += _event("content_block_start", {"index": 0, "content_block": block})
            text = "".join(batch)
            if text:
                delta = {"type": "text_delta", "text": text}
                out += _event("content_block_delta", {"index": 0, "delta": delta})
            await resp.write(out)
        stop = {"stop_reason": _STOP_REASON[gen.finish_reason], "stop_sequence": None}
        usage = {"input_tokens": gen.prompt_tokens, "output_tokens": gen.given}
        await resp.write(
            _event("content_block_stop", {"index": 0})
            + _event("message_delta", {"delta": stop, "usage": usage})
            + _event("message_stop", {})
        )
        await resp.write_eof()
        return resp
