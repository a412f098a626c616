"""OpenAI/vLLM wire format: request Structs, response bodies, SSE chunks and errors.

Requests are decoded with msgspec into Structs holding only the fields the
emulator uses; unknown fields are accepted and ignored, as vLLM does. Errors use
vLLM's ``ErrorResponse`` shape (llama.cpp's is the same)::

    {"error": {"message": str, "type": str, "param": str | null, "code": int}}

where ``code`` is the HTTP status and ``type`` names the error class
(``BadRequestError``, ``NotFoundError``, …); SGLang's is flat (:func:`error_body` with
``flat=True``)::

    {"object": "error", "message": str, "type": str, "param": str | null, "code": int}

An error in the middle of a stream (vLLM, when its engine core dies) is the nested shape as one
``data:`` event, then ``data: [DONE]`` (:func:`stream_error_event`).
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "StreamOptions",
    "ChatCompletionRequest",
    "CompletionRequest",
    "RequestError",
    "ERROR_TYPES",
    "error_body",
    "stream_error_event",
    "decode_chat",
    "decode_completion",
    "usage_dict",
    "ChunkEncoder",
    "SSE_DONE",
]

#: ``error.type`` per HTTP status (the names of the openai client's exception classes).
ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    413: "RequestEntityTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

SSE_DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.encode


class RequestError(Exception):
    """A request the emulator refuses; becomes an error body with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None, *, flat: bool = False) -> bytes:
    """Encode a vLLM ``ErrorResponse`` (``flat``: SGLang's, without the ``error`` wrapper)."""
    error = {
        "message": message,
        "type": ERROR_TYPES.get(status, "InternalServerError"),
        "param": param,
        "code": status,
    }
    return _encode({"object": "error", **error} if flat else {"error": error})


def stream_error_event(message: str, status: int = 500) -> bytes:
    """An in-stream error as vLLM writes it: the error event, then ``[DONE]``."""
    return b"data: " + error_body(status, message) + b"\n\n" + SSE_DONE


class StreamOptions(msgspec.Struct):
    """``stream_options``."""

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _Common(msgspec.Struct):
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    n: int | None = 1
    kv_transfer_params: dict[str, Any] | None = None
    #: SGLang P/D: the prefill engine's bootstrap address and the request's shared room
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    #: vLLM: tokens per SSE event for this request (the server's ``--stream-interval`` if unset)
    stream_interval: int | None = None
    #: llama.cpp: prompt-progress events before the first token
    return_progress: bool = False


class ChatCompletionRequest(_Common):
    """The fields of ``POST /v1/chat/completions`` the emulator reads."""

    messages: list[Any] | msgspec.UnsetType = msgspec.UNSET
    max_completion_tokens: int | None = None
    #: vLLM/SGLang: continue the final (assistant) message instead of starting a new turn
    continue_final_message: bool = False
    add_generation_prompt: bool = True


class CompletionRequest(_Common):
    """The fields of ``POST /v1/completions`` the emulator reads."""

    prompt: str | list[Any] | msgspec.UnsetType = msgspec.UNSET


_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)


def _check_common(req: _Common) -> None:
    if req.n not in (None, 1):
        raise RequestError(400, f"n must be 1 on this engine, got {req.n}", "n")
    if req.max_tokens is not None and req.max_tokens < 1:
        raise RequestError(
            400, f"max_tokens must be at least 1, got {req.max_tokens}.", "max_tokens"
        )
    if req.min_tokens < 0:
        raise RequestError(
            400, f"min_tokens must be at least 0, got {req.min_tokens}.", "min_tokens"
        )
    if req.stream_interval is not None and req.stream_interval < 1:
        raise RequestError(
            400,
            f"stream_interval must be greater than or equal to 1, got {req.stream_interval}.",
            "stream_interval",
        )
    if req.max_tokens is not None and req.min_tokens > req.max_tokens:
        raise RequestError(
            400,
            f"min_tokens must be less than or equal to max_tokens={req.max_tokens}, "
            f"got {req.min_tokens}.",
            "min_tokens",
        )


def _decode(decoder: msgspec.json.Decoder, body: bytes) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise RequestError(400, f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise RequestError(400, f"request body is not valid JSON: {exc}") from None


def decode_chat(body: bytes) -> ChatCompletionRequest:
    """Decode and validate a chat completion request; raise :class:`RequestError` (400)."""
    req: ChatCompletionRequest = _decode(_chat_decoder, body)
    if req.messages is msgspec.UNSET:
        raise RequestError(400, "Field required: 'messages'", "messages")
    if not req.messages:
        raise RequestError(400, "'messages' must contain at least one message", "messages")
    if req.max_completion_tokens is not None:
        if req.max_completion_tokens < 1:
            raise RequestError(
                400,
                f"max_completion_tokens must be at least 1, got {req.max_completion_tokens}.",
                "max_completion_tokens",
            )
        req.max_tokens = req.max_completion_tokens  # the newer name wins, as in vLLM
    if req.continue_final_message and req.add_generation_prompt:
        raise RequestError(
            400,
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
        )
    if req.continue_final_message:
        last = req.messages[-1]
        if not isinstance(last, dict) or last.get("role") != "assistant":
            raise RequestError(
                400,
                "continue_final_message needs a final message with the assistant role",
                "messages",
            )
    _check_common(req)
    return req


def decode_completion(body: bytes) -> CompletionRequest:
    """Decode and validate a completion request; raise :class:`RequestError` (400)."""
    req: CompletionRequest = _decode(_completion_decoder, body)
    if req.prompt is msgspec.UNSET:
        raise RequestError(400, "Field required: 'prompt'", "prompt")
    prompt = req.prompt
    if isinstance(prompt, list):
        # One prompt only: a list of token ids, or a batch of exactly one item.
        if len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = req.prompt = prompt[0]
        if isinstance(prompt, list) and (not prompt or not all(type(t) is int for t in prompt)):
            raise RequestError(
                400,
                "prompt must be a string, a list of token ids, or a batch of one of those",
                "prompt",
            )
    _check_common(req)
    return req


def usage_dict(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None
) -> dict[str, Any]:
    """The ``usage`` object, with ``prompt_tokens_details.cached_tokens`` (null when None:
    vLLM started without ``--enable-prompt-tokens-details``)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": (
            None if cached_tokens is None else {"cached_tokens": cached_tokens}
        ),
    }


class ChunkEncoder:
    """Builds the SSE chunks of one streamed response, OpenAI's exact format.

    Per-token chunks are a precomputed prefix, the JSON-encoded text and a
    precomputed suffix, so a token costs one small ``msgspec`` encode.

    Parameters
    ----------
    chat : bool
        ``chat.completion.chunk`` (delta) or ``text_completion`` (text) chunks.
    response_id : str
        The response id (``chatcmpl-…`` / ``cmpl-…``).
    created : int
        Unix time of creation.
    model : str
        Served model name.
    """

    __slots__ = ("chat", "_head", "_prefix", "_suffix")

    def __init__(self, chat: bool, response_id: str, created: int, model: str) -> None:
        self.chat = chat
        obj = "chat.completion.chunk" if chat else "text_completion"
        self._head = (
            b'{"id":'
            + _encode(response_id)
            + b',"object":"'
            + obj.encode()
            + b'","created":'
            + str(created).encode()
            + b',"model":'
            + _encode(model)
        )
        if chat:
            self._prefix = b"data: " + self._head + b',"choices":[{"index":0,"delta":{"content":'
            self._suffix = b'},"logprobs":null,"finish_reason":null}]}\n\n'
        else:
            self._prefix = b"data: " + self._head + b',"choices":[{"index":0,"text":'
            self._suffix = b',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'

    def role(self, usage: dict[str, Any] | None = None) -> bytes:
        """The first chat chunk: ``delta`` with the assistant role and empty content (and the
        ``usage`` so far, with ``continuous_usage_stats``)."""
        tail = b"" if usage is None else b',"usage":' + _encode(usage)
        return (
            b"data: " + self._head + b',"choices":[{"index":0,"delta":{"role":"assistant",'
            b'"content":""},"logprobs":null,"finish_reason":null}]' + tail + b"}\n\n"
        )

    def token(self, text: str) -> bytes:
        """A chunk carrying one token's text."""
        return self._prefix + _encode(text) + self._suffix

    def last(self, text: str, finish_reason: str, extra: dict[str, Any] | None = None) -> bytes:
        """The chunk of the last token, with its ``finish_reason`` (and top-level ``extra``)."""
        if self.chat:
            choice = b'{"index":0,"delta":{"content":' + _encode(text) + b'},"logprobs":null,'
        else:
            choice = b'{"index":0,"text":' + _encode(text) + b',"logprobs":null,'
        choice += b'"finish_reason":' + _encode(finish_reason) + b',"stop_reason":null}'
        tail = b""
        if extra:
            tail = b"," + _encode(extra)[1:-1]
        return b"data: " + self._head + b',"choices":[' + choice + b"]" + tail + b"}\n\n"

    def usage(self, usage: dict[str, Any]) -> bytes:
        """The final ``stream_options.include_usage`` chunk: no choices, the usage."""
        return b"data: " + self._head + b',"choices":[],"usage":' + _encode(usage) + b"}\n\n"

    def event(
        self,
        text: str,
        *,
        field: str = "content",
        finish_reason: str | None = None,
        usage: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> bytes:
        """Any chunk: ``text`` in delta ``field`` (``content``, or ``reasoning`` /
        ``reasoning_content`` for reasoning tokens; ``text`` for completions), with its
        ``finish_reason``, per-chunk ``usage`` (``continuous_usage_stats``) and top-level
        ``extra``. Slower than :meth:`token`; used when one of those is needed."""
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {field: text}, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        choice["finish_reason"] = finish_reason
        if finish_reason is not None or not self.chat:
            choice["stop_reason"] = None
        tail = b""
        if usage is not None:
            tail += b',"usage":' + _encode(usage)
        if extra:
            tail += b"," + _encode(extra)[1:-1]
        return b"data: " + self._head + b',"choices":[' + _encode(choice) + b"]" + tail + b"}\n\n"

    def progress(self, total: int, cache: int, processed: int, time_ms: int) -> bytes:
        """llama.cpp's ``return_progress`` chunk: an empty assistant delta and
        ``prompt_progress``."""
        choice = b'{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}'
        progress = _encode(
            {"total": total, "cache": cache, "processed": processed, "time_ms": time_ms}
        )
        return (
            b"data: " + self._head + b',"choices":[' + choice + b'],"prompt_progress":'
            + progress + b"}\n\n"
        )  # fmt: skip
