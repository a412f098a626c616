"""Anthropic-shaped errors on the Messages endpoints (``/v1/messages``, ``/count_tokens``).

The request path builds every error in OpenAI's shape
(:mod:`~fastroute.proxy.http.openai_errors`); on the Messages endpoints the reply is
converted once, at the endpoint's boundary (:func:`to_anthropic`), into Anthropic's
``{"type": "error", "error": {"type", "message"}}`` so the official ``anthropic``
client raises its typed exceptions. The status is kept; the type follows it
(:data:`ANTHROPIC_TYPE_BY_STATUS`). A body that already is Anthropic-shaped (vLLM's
Messages errors) keeps its message and gets the type of its status.

In a stream, the relay's OpenAI-shaped error event (``data: {"error": ...}``) becomes
Anthropic's ``event: error`` (:func:`anthropic_sse_error`).
"""

from __future__ import annotations

import msgspec

from fastroute.proxy.http.openai_errors import parse_error_body
from fastroute.proxy.http.reply import Reply

__all__ = [
    "ANTHROPIC_TYPE_BY_STATUS",
    "anthropic_error_body",
    "anthropic_sse_error",
    "to_anthropic",
    "sse_error_to_anthropic",
]

#: Anthropic's ``error.type`` for each status the proxy returns.
ANTHROPIC_TYPE_BY_STATUS: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "api_error",
    529: "overloaded_error",
}
_DEFAULT_MESSAGE = "The request failed (HTTP {status})."
_OPENAI_SSE_ERROR = b'data: {"error"'
_encode = msgspec.json.encode


def _type_of(status: int) -> str:
    return ANTHROPIC_TYPE_BY_STATUS.get(
        status, "api_error" if status >= 500 else "invalid_request_error"
    )


def anthropic_error_body(status: int, message: str) -> bytes:
    """``{"type": "error", "error": {"type", "message"}}`` for ``status``, encoded."""
    return _encode({"type": "error", "error": {"type": _type_of(status), "message": message}})


def to_anthropic(reply: Reply) -> None:
    """Rewrite an error ``reply`` (status >= 400, not streamed) in Anthropic's shape, in place."""
    if reply.status < 400 or reply.streamed:
        return
    fields = parse_error_body(reply.body) if reply.body else None
    message = fields.message if fields is not None and fields.message else None
    reply.body = anthropic_error_body(
        reply.status, message or _DEFAULT_MESSAGE.format(status=reply.status)
    )
    reply.headers = [(k, v) for k, v in reply.headers if k.lower() != "content-type"]
    reply.headers.append(("Content-Type", "application/json"))


def anthropic_sse_error(message: str, status: int = 500) -> bytes:
    """Anthropic's in-stream ``event: error`` with its data line and the blank line."""
    return b"event: error\ndata: " + anthropic_error_body(status, message) + b"\n\n"


def sse_error_to_anthropic(data: bytes) -> bytes:
    """``data`` with an OpenAI-shaped error event in it rewritten as :func:`anthropic_sse_error`."""
    start = data.find(_OPENAI_SSE_ERROR)
    if start < 0:
        return data
    end = data.find(b"\n\n", start)
    payload = data[start + len(b"data: ") : None if end < 0 else end]
    fields = parse_error_body(payload)
    message = fields.message if fields is not None and fields.message else "stream failed"
    rest = b"" if end < 0 else data[end + 2 :]
    return data[:start] + anthropic_sse_error(message) + rest
