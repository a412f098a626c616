"""Engine error bodies of every shape, and the OpenAI error bodies the proxy writes."""

from __future__ import annotations

import msgspec
import pytest

from fastroute.proxy.http.openai_errors import (
    ErrorFields,
    error_reply,
    parse_error_body,
    sse_error_event,
)

_VLLM = (
    b'{"error":{"message":"max_tokens must be at least 1, got -1.","type":"BadRequestError",'
    b'"param":"max_tokens","code":400}}'
)
_SGLANG = (
    b'{"object": "error", "message": "Requested token count exceeds the context length",'
    b' "type": "BadRequestError", "param": null, "code": 400}'
)
_LLAMACPP = b'{"error":{"code":400,"message":"the request exceeds the context size","type":"invalid_request_error"}}'  # noqa: E501
_OPENAI = b'{"error":{"message":"no such model","type":"invalid_request_error","param":"model","code":"model_not_found"}}'  # noqa: E501


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            _VLLM,
            ErrorFields(
                "max_tokens must be at least 1, got -1.", "BadRequestError", "max_tokens", 400
            ),
        ),
        (
            _SGLANG,
            ErrorFields(
                "Requested token count exceeds the context length", "BadRequestError", None, 400
            ),
        ),
        (
            _LLAMACPP,
            ErrorFields("the request exceeds the context size", "invalid_request_error", None, 400),
        ),
        (
            _OPENAI,
            ErrorFields("no such model", "invalid_request_error", "model", "model_not_found"),
        ),
        (b'{"error": "overloaded"}', ErrorFields("overloaded", None, None, None)),
        (b'{"detail": "Not Found"}', ErrorFields("Not Found", None, None, None)),
        (b'{"error": {"message": 5, "code": true}}', ErrorFields(None, None, None, None)),
        (b"[1, 2]", ErrorFields(None, None, None, None)),
    ],
    ids=["vllm", "sglang-flat", "llamacpp", "openai", "string", "fastapi", "bad-types", "list"],
)
def test_every_engine_error_shape_is_read(data: bytes, expected: ErrorFields) -> None:
    assert parse_error_body(data) == expected


def test_a_body_that_is_not_json_has_no_fields() -> None:
    assert parse_error_body(b"<html>502 Bad Gateway</html>") is None
    assert parse_error_body(b"") is None


def test_an_integer_code_is_written_as_an_integer() -> None:
    reply = error_reply(400, "no", code=400, param="n", type="BadRequestError")
    assert msgspec.json.decode(reply.body) == {
        "error": {"message": "no", "type": "BadRequestError", "param": "n", "code": 400}
    }
    event = sse_error_event("broke", code=500)
    assert msgspec.json.decode(event[len(b"data: ") :])["error"]["code"] == 500
