"""OpenAI-shaped error responses of the proxy.

Every error the proxy produces itself has OpenAI's body,
``{"error": {"message", "type", "param", "code"}}``, so the official ``openai``
client raises the matching exception (400 ``BadRequestError``, 404 ``NotFoundError``,
429 ``RateLimitError``, 5xx ``InternalServerError``...). Mid-stream failures cannot
change the status any more; they are reported as one SSE event carrying the same
body (the ``openai`` client raises ``APIError`` on it).

Status mapping (style.md §3.1): bad input 400, unknown model or route 404, body too
large 413, shed or admission 429, no engine 503, upstream connect error or 5xx 502,
upstream timeout 504.

Engines answer errors in one of two shapes, both read by :func:`parse_error_body`:
wrapped like OpenAI's (vLLM, llama.cpp; ``code`` an integer, vLLM's equal to the HTTP
status) or flat, ``{"object": "error", "message", "type", "param", "code"}`` (SGLang's
``ErrorResponse``). A ``code`` is relayed as the engine sent it, string or integer
(OpenAI's own codes are strings; the ``openai`` client accepts either).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import msgspec

from fastroute.proxy.http.reply import Reply

__all__ = [
    "error_body",
    "error_reply",
    "sse_error_event",
    "parse_error_body",
    "ErrorFields",
    "ErrorCode",
    "TYPE_BY_STATUS",
]

#: An error's ``code``: OpenAI's are strings, vLLM's, SGLang's and llama.cpp's integers.
ErrorCode = str | int

#: The ``error.type`` OpenAI uses for each status the proxy returns.
TYPE_BY_STATUS: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}

_encode = msgspec.json.encode


def error_body(
    message: str,
    *,
    type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
    param: str | None = None,
    code: ErrorCode | None = None,
) -> dict[str, dict[str, Any]]:
    """Return ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_reply(
    status: int,
    message: str,
    *,
    code: ErrorCode | None = None,
    param: str | None = None,
    type: str | None = None,  # noqa: A002 - OpenAI's field name
    headers: Mapping[str, str] | None = None,
) -> Reply:
    """Build an OpenAI-shaped JSON error as a :class:`~fastroute.proxy.http.reply.Reply`.

    Parameters
    ----------
    status : int
        HTTP status.
    message : str
        Human-readable message: what was expected and what was found.
    code : str or int, optional
        Machine-readable code (``"model_not_found"``, ``"no_engine_available"``...; an
        engine's integer code is relayed as it is).
    param : str, optional
        The request parameter at fault (``"model"``, ``"messages[0].role"``).
    type : str, optional
        ``error.type``; default from :data:`TYPE_BY_STATUS`.
    headers : mapping, optional
        Extra response headers (``Retry-After``...).

    Returns
    -------
    Reply
    """
    body = _error_json(status, message, type, param, code)
    pairs = [("Content-Type", "application/json")]
    if headers:
        pairs.extend(headers.items())
    return Reply(status, pairs, body)


def _error_json(
    status: int,
    message: str,
    type: str | None,
    param: str | None,
    code: ErrorCode | None,  # noqa: A002
) -> bytes:
    """The encoded error body; ``type`` defaults from the status (:data:`TYPE_BY_STATUS`)."""
    kind = type or TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "api_error")
    return _encode(error_body(message, type=kind, param=param, code=code))


def sse_error_event(
    message: str,
    *,
    code: ErrorCode | None = None,
    type: str = "server_error",  # noqa: A002
) -> bytes:
    """One SSE event ``data: {"error": {...}}`` followed by the blank line."""
    return b"data: " + _encode(error_body(message, type=type, code=code)) + b"\n\n"


class ErrorFields(NamedTuple):
    """The fields of an engine's error body (each None when absent or of another type)."""

    message: str | None
    type: str | None
    param: str | None
    code: ErrorCode | None


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def parse_error_body(data: bytes) -> ErrorFields | None:
    """The fields of an engine's error body, wrapped or flat; None when it is not JSON.

    Accepted shapes: ``{"error": {"message", "type", "param", "code"}}`` (OpenAI, vLLM,
    llama.cpp), ``{"error": "message"}``, the flat ``{"object": "error", "message",
    "type", "param", "code"}`` (SGLang) and FastAPI's ``{"detail": "message"}`` (vLLM's
    unknown routes). ``code`` is kept when a string or an integer (not a bool).
    """
    try:
        body = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
    if not isinstance(body, dict):
        return ErrorFields(None, None, None, None)
    err = body.get("error")
    if isinstance(err, str):
        return ErrorFields(err or None, None, None, None)
    if not isinstance(err, dict):  # flat (SGLang) or FastAPI's detail
        err = body
        if not isinstance(err.get("message"), str) and isinstance(err.get("detail"), str):
            err = {"message": err["detail"]}
    code = err.get("code")
    if isinstance(code, bool) or not isinstance(code, str | int):
        code = None
    return ErrorFields(
        _str_or_none(err.get("message")) or None,
        _str_or_none(err.get("type")),
        _str_or_none(err.get("param")),
        code,
    )
