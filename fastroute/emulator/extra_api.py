"""The emulated engine's endpoints besides generation, in vLLM 0.32's shapes.

Answered at once (no scheduling: these requests never enter the step loop), with the
engine's fault and availability rules (503 while loading or draining, injected errors),
its body limit (413) and its model check (404 for another model; the engine's LoRA
adapters are its models too):

``POST /tokenize``
    ``{"prompt": str}`` or ``{"messages": [...]}`` (rendered with the emulator's chat
    template, :func:`fastroute.tokens.render_chat`) → ``{"count", "max_model_len",
    "tokens", "token_strs"}``. Token ids are the emulator's own tokenizer stand-in
    (:func:`fastroute.tokens.text_token_ids`), so ``count`` is the ``prompt_tokens`` a
    completion of the same prompt reports.
``POST /detokenize``
    ``{"tokens": [int]}`` → ``{"prompt": str}``, the inverse.
``POST /pooling``, ``POST /classify``
    ``{"input": str | [str]}`` → a list of ``pooling`` vectors / class probabilities.
``POST /score``, ``/v1/score``
    ``text_1``/``text_2``, ``queries``/``documents``, ``queries``/``items`` or
    ``data_1``/``data_2`` → one ``score`` per pair (word-set overlap, in [0, 1]).
``POST /rerank``, ``/v1/rerank``, ``/v2/rerank``
    ``{"query", "documents", "top_n"}`` → ``results`` by ``relevance_score``, best first.
``POST /v1/audio/transcriptions``, ``/v1/audio/translations``
    ``multipart/form-data`` with ``file`` and ``model`` (and ``response_format``,
    ``stream``) → ``{"text", "usage": {"type": "duration", "seconds"}}`` (translations:
    ``{"text"}``), ``text/plain`` for ``response_format=text``, SSE
    ``transcription.chunk`` events for ``stream=true``.

The scores, vectors and transcripts are deterministic functions of the input, not models
of anything: they exist so a router can be tested against the right shapes.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from fastroute.hashing import key_hash
from fastroute.tokens import render_chat, text_token_ids, token_ids_text

if TYPE_CHECKING:
    from fastroute.emulator.server import EmulatedEngine

__all__ = [
    "add_extra_routes",
    "SCORE_PATHS",
    "RERANK_PATHS",
    "AUDIO_PATHS",
    "POOLING_DIMENSIONS",
    "AUDIO_BYTES_PER_SECOND",
    "CLASSIFY_LABELS",
]

#: The score endpoint and its alias.
SCORE_PATHS = ("/score", "/v1/score")
#: The rerank endpoint and its aliases.
RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")
#: The audio endpoints, by the object their stream chunks name.
AUDIO_PATHS = {
    "/v1/audio/transcriptions": "transcription",
    "/v1/audio/translations": "translation",
}
#: Length of a ``/pooling`` vector.
POOLING_DIMENSIONS = 8
#: Audio bytes per second of ``usage.seconds`` (16 kHz, 16-bit mono PCM).
AUDIO_BYTES_PER_SECOND = 32_000
#: The labels of ``/classify``.
CLASSIFY_LABELS = ("negative", "positive")
#: Words per SSE event of a streamed transcription.
_WORDS_PER_EVENT = 2

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _BadRequest(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _texts(value: Any, param: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    if isinstance(value, dict) and isinstance(value.get("text"), str):
        return [value["text"]]
    raise _BadRequest(400, f"`{param}` must be a string or a list of strings", param)


def _words(text: str) -> set[str]:
    return set(text.lower().split())


def _overlap(a: str, b: str) -> float:
    """Jaccard similarity of the word sets, in [0, 1]."""
    wa, wb = _words(a), _words(b)
    union = wa | wb
    return len(wa & wb) / len(union) if union else 1.0


def _unit(seed: str, i: int) -> float:
    return (key_hash(f"{seed}\0{i}".encode()) & 0xFFFF) / 0xFFFF


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


class _ExtraApi:
    """The handlers, over one engine."""

    def __init__(self, engine: EmulatedEngine) -> None:
        self.engine = engine

    # -- shared steps --------------------------------------------------------------------------

    def _json(self, data: Any) -> web.Response:
        return web.Response(
            body=msgspec.json.encode(data),
            content_type="application/json",
            headers={"x-fastroute-engine": self.engine.name},
        )

    def _refusal(self) -> web.Response | None:
        engine = self.engine
        reason = engine._unavailable()
        if reason is not None:
            return engine._error(503, reason)
        injected = engine.faults.draw_error()
        if injected is not None:
            return engine._error(
                injected, f"injected fault: engine {engine.name} fails this request"
            )
        return None

    def _check_model(self, model: Any) -> str:
        spec = self.engine.spec
        if model is None:
            return spec.model_name
        if model != spec.model_name and model not in spec.lora_adapters:
            raise _BadRequest(404, f"The model `{model}` does not exist.", "model")
        return str(model)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        limit = self.engine.spec.max_body_bytes
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _BadRequest(413, f"request body exceeds the limit of {limit} bytes") from None
        if len(body) > limit:
            raise _BadRequest(413, f"request body exceeds the limit of {limit} bytes")
        try:
            data = msgspec.json.decode(body)
        except msgspec.DecodeError as exc:
            raise _BadRequest(400, f"Invalid JSON body: {exc}") from None
        if not isinstance(data, dict):
            raise _BadRequest(400, "The request body must be a JSON object")
        return data

    def wrap(self, answer: Callable[[dict[str, Any]], Any]) -> _Handler:
        """A JSON endpoint: refusal, body, model check, then ``answer(body)``."""

        async def handler(request: web.Request) -> web.StreamResponse:
            refused = self._refusal()
            if refused is not None:
                return refused
            try:
                data = await self._body(request)
                data["model"] = self._check_model(data.get("model"))
                return self._json(answer(data))
            except _BadRequest as exc:
                return self.engine._error(exc.status, exc.message, exc.param)

        return handler

    # -- tokenizer -----------------------------------------------------------------------------

    def tokenize(self, data: dict[str, Any]) -> dict[str, Any]:
        if "messages" in data:
            messages = data["messages"]
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise _BadRequest(400, "`messages` must be a list of message objects", "messages")
            text = render_chat(messages)
        else:
            prompt = data.get("prompt")
            if not isinstance(prompt, str):
                raise _BadRequest(400, "`prompt` (a string) or `messages` is required", "prompt")
            text = prompt
        tokens = text_token_ids(text)
        strs = [token_ids_text([t]) for t in tokens] if data.get("return_token_strs") else None
        return {
            "count": len(tokens),
            "max_model_len": self.engine.model.max_model_len,
            "tokens": tokens,
            "token_strs": strs,
        }

    def detokenize(self, data: dict[str, Any]) -> dict[str, Any]:
        tokens = data.get("tokens")
        if not isinstance(tokens, list):
            raise _BadRequest(400, "`tokens` must be a list of token ids", "tokens")
        try:
            return {"prompt": token_ids_text(tokens)}
        except ValueError as exc:
            raise _BadRequest(400, str(exc), "tokens") from None

    # -- pooling, scoring ----------------------------------------------------------------------

    def pooling(self, data: dict[str, Any]) -> dict[str, Any]:
        texts = _texts(data.get("input"), "input")
        rows = [
            {
                "index": i,
                "object": "pooling",
                "data": [_unit(t, d) for d in range(POOLING_DIMENSIONS)],
            }
            for i, t in enumerate(texts)
        ]
        return self._listed("pool", data, rows, texts)

    def classify(self, data: dict[str, Any]) -> dict[str, Any]:
        texts = _texts(data.get("input"), "input")
        rows = []
        for i, t in enumerate(texts):
            p = _unit(t, 0)
            probs = [1.0 - p, p]
            label = CLASSIFY_LABELS[int(p >= 0.5)]
            rows.append({"index": i, "label": label, "probs": probs, "num_classes": len(probs)})
        return self._listed("classify", data, rows, texts)

    def score(self, data: dict[str, Any]) -> dict[str, Any]:
        for first, second in (
            ("text_1", "text_2"),
            ("queries", "documents"),
            ("queries", "items"),
            ("data_1", "data_2"),
        ):
            if first in data and second in data:
                break
        else:
            raise _BadRequest(
                400, "`text_1` and `text_2` (or `queries` and `documents`) are required"
            )
        left, right = _texts(data[first], first), _texts(data[second], second)
        if len(left) == 1:
            left = left * len(right)
        if len(left) != len(right):
            raise _BadRequest(400, f"`{first}` must have one item or as many as `{second}`", first)
        rows = [
            {"index": i, "object": "score", "score": _overlap(a, b)}
            for i, (a, b) in enumerate(zip(left, right, strict=True))
        ]
        return self._listed("score", data, rows, left + right)

    def rerank(self, data: dict[str, Any]) -> dict[str, Any]:
        query = _texts(data.get("query"), "query")[0]
        documents = _texts(data.get("documents"), "documents")
        top_n = data.get("top_n") or len(documents)
        if not isinstance(top_n, int) or top_n < 0:
            raise _BadRequest(400, "`top_n` must be a non-negative integer", "top_n")
        scored = sorted(
            ((_overlap(query, d), i, d) for i, d in enumerate(documents)),
            key=lambda s: (-s[0], s[1]),
        )
        tokens = sum(len(text_token_ids(t)) for t in [query, *documents])
        return {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": data["model"],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": [
                {"index": i, "document": {"text": d}, "relevance_score": s}
                for s, i, d in scored[:top_n]
            ],
        }

    def _listed(
        self, prefix: str, data: dict[str, Any], rows: list[dict[str, Any]], texts: list[str]
    ) -> dict[str, Any]:
        tokens = sum(len(text_token_ids(t)) for t in texts)
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": data["model"],
            "data": rows,
            "usage": _usage(tokens),
        }

    # -- audio ---------------------------------------------------------------------------------

    async def audio(self, request: web.Request) -> web.StreamResponse:
        refused = self._refusal()
        if refused is not None:
            return refused
        engine = self.engine
        try:
            form = await self._form(request)
            model = self._check_model(form.get("model"))
        except _BadRequest as exc:
            return engine._error(exc.status, exc.message, exc.param)
        audio = form.get("file")
        if not isinstance(audio, bytes) or not audio:
            return engine._error(400, "`file` (the audio) is required", "file")
        seconds = max(1, math.ceil(len(audio) / AUDIO_BYTES_PER_SECOND))
        text = f"emulated {AUDIO_PATHS[request.path]} of {seconds} s of audio by {model}"
        if str(form.get("stream", "false")).lower() == "true":
            return await self._audio_stream(request, model, text)
        if form.get("response_format") == "text":
            return web.Response(
                text=text, content_type="text/plain", headers={"x-fastroute-engine": engine.name}
            )
        body: dict[str, Any] = {"text": text}
        if AUDIO_PATHS[request.path] == "transcription":
            body["usage"] = {"type": "duration", "seconds": seconds}
        return self._json(body)

    async def _form(self, request: web.Request) -> dict[str, Any]:
        limit = self.engine.spec.max_body_bytes
        if request.content_type != "multipart/form-data":
            raise _BadRequest(400, "the body must be multipart/form-data")
        out: dict[str, Any] = {}
        try:
            reader = await request.multipart()
            async for part in reader:
                if part.name is None or not hasattr(part, "read"):
                    continue
                data = await part.read()
                out[part.name] = bytes(data) if part.filename else data.decode("utf-8", "replace")
        except web.HTTPRequestEntityTooLarge:
            raise _BadRequest(413, f"request body exceeds the limit of {limit} bytes") from None
        except ValueError as exc:
            raise _BadRequest(400, f"malformed multipart body: {exc}") from None
        return out

    async def _audio_stream(
        self, request: web.Request, model: str, text: str
    ) -> web.StreamResponse:
        engine = self.engine
        kind = AUDIO_PATHS[request.path]
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "x-fastroute-engine": engine.name}
        )
        await resp.prepare(request)
        rid, created = f"{kind[:5]}-{uuid.uuid4().hex}", int(time.time())
        words = text.split(" ")
        for i in range(0, len(words), _WORDS_PER_EVENT):
            piece = " ".join(words[i : i + _WORDS_PER_EVENT]) + " "
            chunk = {
                "id": rid,
                "object": f"{kind}.chunk",
                "created": created,
                "model": model,
                "choices": [{"delta": {"content": piece}, "finish_reason": None}],
            }
            await resp.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def add_extra_routes(app: web.Application, engine: EmulatedEngine) -> None:
    """Add the endpoints of this module to ``engine``'s aiohttp app."""
    api = _ExtraApi(engine)
    app.router.add_post("/tokenize", api.wrap(api.tokenize))
    app.router.add_post("/detokenize", api.wrap(api.detokenize))
    app.router.add_post("/pooling", api.wrap(api.pooling))
    app.router.add_post("/classify", api.wrap(api.classify))
    for path in SCORE_PATHS:
        app.router.add_post(path, api.wrap(api.score))
    for path in RERANK_PATHS:
        app.router.add_post(path, api.wrap(api.rerank))
    for path in AUDIO_PATHS:
        app.router.add_post(path, api.audio)
