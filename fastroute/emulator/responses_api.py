"""The emulated engine's Responses API, shaped like vLLM 0.32's.

``POST /v1/responses``
    ``instructions`` + ``input`` (a string or items) rendered to chat messages; with
    ``previous_response_id`` the stored conversation comes first (404 in OpenAI shape,
    vLLM's message, for an unknown id). Not streamed: the ``response`` object; streamed:
    vLLM's event sequence, each ``event: <type>`` + ``data: {...}`` with a
    ``sequence_number``: ``response.created``, ``response.in_progress``,
    ``response.output_item.added``, ``response.content_part.added``,
    ``response.output_text.delta`` (one per engine step), ``response.output_text.done``,
    ``response.content_part.done``, ``response.output_item.done``,
    ``response.completed`` (with ``usage``).
``GET /v1/responses/{id}``
    The stored response, or 404.
``POST /v1/responses/{id}/cancel``
    vLLM's answers: 404 for an unknown id, 400 for a finished (not background) one.

Responses are stored unless the body says ``"store": false`` (vLLM stores only with
``VLLM_ENABLE_RESPONSES_API_STORE=1``; the emulator always may), at most
:data:`MAX_STORED_RESPONSES` per engine, the oldest dropped first.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
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

__all__ = ["ResponsesAPI", "MAX_STORED_RESPONSES"]

#: Stored responses per engine (the oldest is dropped beyond).
MAX_STORED_RESPONSES = 4096
_STREAM_ERROR_MESSAGE = (
    "EngineCore encountered an issue. See stack trace (above) for the root cause."
)
_encode = msgspec.json.encode


class _ResponsesBody(msgspec.Struct):
    model: str | None = None
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    previous_response_id: str | None = None
    stream: bool | None = False
    store: bool | None = True
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None


_decoder = msgspec.json.Decoder(_ResponsesBody)


def _part_text(part: Any) -> str:
    if isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text"):
        return str(part.get("text") or "")
    return ""


def input_messages(body: _ResponsesBody) -> list[dict[str, Any]]:
    """The chat messages of a body's ``instructions`` and ``input`` (vLLM's rendering:
    instructions as the system message, text parts joined)."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
        return messages
    for item in body.input:
        kind = item.get("type", "message")
        if kind == "message":
            content = item.get("content")
            text = content if isinstance(content, str) else "".join(map(_part_text, content or []))
            messages.append({"role": str(item.get("role", "user")), "content": text})
        else:  # tool calls and their outputs: their text, under the item's type
            payload = item.get("output", item.get("arguments", ""))
            text = payload if isinstance(payload, str) else _encode(payload).decode()
            messages.append({"role": str(kind), "content": text})
    return messages


def _error(engine: EmulatedEngine, status: int, message: str, param: str | None) -> web.Response:
    etype = "invalid_request_error" if param == "response_id" else ERROR_TYPES.get(status)
    body = {
        "error": {
            "message": message,
            "type": etype or "InternalServerError",
            "param": param,
            "code": status,
        }
    }
    return web.json_response(body, status=status, headers={"x-fastroute-engine": engine.name})


def _not_found(engine: EmulatedEngine, response_id: str) -> web.Response:
    return _error(engine, 404, f"Response with id '{response_id}' not found.", "response_id")


class _Stored(msgspec.Struct):
    response: dict[str, Any]
    conversation: list[dict[str, Any]]


class ResponsesAPI:
    """The Responses routes of one emulated engine (see the module docstring)."""

    def __init__(self, engine: EmulatedEngine) -> None:
        self.engine = engine
        self.stored: OrderedDict[str, _Stored] = OrderedDict()

    def install(self, app: web.Application) -> None:
        """Add the routes to the engine's app."""
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{response_id}", self.retrieve)
        app.router.add_post("/v1/responses/{response_id}/cancel", self.cancel)

    def _err(self, status: int, message: str, param: str | None) -> web.Response:
        return _error(self.engine, status, message, param)

    async def retrieve(self, request: web.Request) -> web.Response:
        """``GET /v1/responses/{id}``."""
        response_id = request.match_info["response_id"]
        stored = self.stored.get(response_id)
        if stored is None:
            return _not_found(self.engine, response_id)
        return web.json_response(stored.response, headers={"x-fastroute-engine": self.engine.name})

    async def cancel(self, request: web.Request) -> web.Response:
        """``POST /v1/responses/{id}/cancel``: nothing here runs in the background."""
        response_id = request.match_info["response_id"]
        if response_id not in self.stored:
            return _not_found(self.engine, response_id)
        return _error(self.engine, 400, "Cannot cancel a synchronous response.", "response_id")

    async def create(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/responses``."""
        engine = self.engine
        body = await read_body(engine, request, self._err)
        if isinstance(body, web.Response):
            return body
        try:
            try:
                parsed = _decoder.decode(body)
            except msgspec.DecodeError as exc:
                raise RequestError(400, f"invalid request: {exc}") from None
            if parsed.model is not None and parsed.model != engine.spec.model_name:
                raise RequestError(404, f"The model `{parsed.model}` does not exist.", "model")
            history: list[dict[str, Any]] = []
            if parsed.previous_response_id is not None:
                previous = self.stored.get(parsed.previous_response_id)
                if previous is None:
                    return _not_found(engine, parsed.previous_response_id)
                history = previous.conversation
            conversation = history + input_messages(parsed)
            prompt = tokenize_messages(conversation, "input")
            if engine.faults.state.hang:  # before the submit, as for chat
                return await engine._hang(request)
            gen = admit(engine, prompt, Sampling(max_tokens=parsed.max_output_tokens), "resp_")
        except RequestError as exc:
            return self._err(exc.status, exc.message, exc.param)
        call = _Call(self, parsed, gen, conversation)
        try:
            if parsed.stream:
                return await call.stream(request)
            return await call.whole()
        except Abort:
            abort_connection(request)
        finally:
            gen.close()

    def store(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """Keep a finished response (and its conversation) for follow-ups and retrieves."""
        self.stored[response["id"]] = _Stored(response, conversation)
        while len(self.stored) > MAX_STORED_RESPONSES:
            self.stored.popitem(last=False)


class _Call:
    """One ``POST /v1/responses`` being answered."""

    def __init__(
        self,
        api: ResponsesAPI,
        parsed: _ResponsesBody,
        gen: Generation,
        conversation: list[dict[str, Any]],
    ) -> None:
        self.api = api
        self.parsed = parsed
        self.gen = gen
        self.conversation = conversation
        self.response_id = gen.mreq.request_id
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.sequence = 0

    def _response(self, status: str, text: str | None) -> dict[str, Any]:
        """The ``response`` object (``text`` None: no output yet)."""
        parsed, gen = self.parsed, self.gen
        output = []
        if text is not None:
            output.append(self._item("completed", text))
        usage = None
        if text is not None:
            usage = {
                "input_tokens": gen.prompt_tokens,
                "input_tokens_details": {"cached_tokens": gen.cached_tokens},
                "output_tokens": gen.given,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": gen.prompt_tokens + gen.given,
            }
        incomplete = status == "incomplete"
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.api.engine.spec.model_name,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": parsed.instructions,
            "metadata": parsed.metadata,
            "output": output,
            "parallel_tool_calls": True,
            "previous_response_id": parsed.previous_response_id,
            "max_output_tokens": parsed.max_output_tokens,
            "temperature": parsed.temperature if parsed.temperature is not None else 1.0,
            "top_p": parsed.top_p if parsed.top_p is not None else 1.0,
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": [],
            "truncation": "disabled",
            "background": False,
            "store": bool(parsed.store),
            "user": parsed.user,
            "usage": usage,
        }

    def _item(self, status: str, text: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {
            "id": self.item_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content if status == "completed" or text else [],
        }

    def _finish(self, text: str) -> dict[str, Any]:
        status = "incomplete" if self.gen.finish_reason == "length" else "completed"
        response = self._response(status, text)
        if self.parsed.store is not False:
            conversation = [*self.conversation, {"role": "assistant", "content": text}]
            self.api.store(response, conversation)
        return response

    async def whole(self) -> web.Response:
        texts: list[str] = []
        async for batch in self.gen.batches():
            if self.gen.stream_error_due():
                return self.api._err(500, _STREAM_ERROR_MESSAGE, None)
            texts.extend(batch)
        return web.json_response(
            self._finish("".join(texts)), headers={"x-fastroute-engine": self.api.engine.name}
        )

    def _event(self, event: dict[str, Any]) -> bytes:
        event["sequence_number"] = self.sequence
        self.sequence += 1
        return b"event: %b\ndata: %b\n\n" % (event["type"].encode(), _encode(event))

    async def stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "x-fastroute-engine": self.api.engine.name,
            }
        )
        await resp.prepare(request)
        initial = self._response("in_progress", None)
        await resp.write(
            self._event({"type": "response.created", "response": initial})
            + self._event({"type": "response.in_progress", "response": initial})
        )
        texts: list[str] = []
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        async for batch in self.gen.batches():
            if self.gen.stream_error_due():
                error = {
                    "type": "error",
                    "code": "500",
                    "message": _STREAM_ERROR_MESSAGE,
                    "param": None,
                }
                await resp.write(self._event(error))
                await resp.write_eof()
                return resp
            out = b""
            if not texts:
                out += self._event(
                    {
                        "type": "response.output_item.added",
                        "output_index": 0,
                        "item": self._item("in_progress", ""),
                    }
                )
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                out += self._event({"type": "response.content_part.added", **where, "part": part})
            texts.extend(batch)
            delta = "".join(batch)
            if delta:
                out += self._event(
                    {"type": "response.output_text.delta", **where, "delta": delta, "logprobs": []}
                )
            await resp.write(out)
        text = "".join(texts)
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        final = self._finish(text)
        await resp.write(
            self._event(
                {"type": "response.output_text.done", **where, "text": text, "logprobs": []}
            )
            + self._event({"type": "response.content_part.done", **where, "part": part})
            + self._event(
                {
                    "type": "response.output_item.done",
                    "output_index": 0,
                    "item": self._item("completed", text),
                }
            )
            + self._event({"type": "response.completed", "response": final})
        )
        await resp.write_eof()
        return resp
