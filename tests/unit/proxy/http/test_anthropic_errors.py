"""OpenAI-shaped replies and stream events rewritten in Anthropic's error shape."""

from __future__ import annotations

import msgspec
import pytest

from fastroute.proxy.http.anthropic_errors import (
    anthropic_sse_error,
    sse_error_to_anthropic,
    to_anthropic,
)
from fastroute.proxy.http.openai_errors import error_reply, sse_error_event
from fastroute.proxy.http.reply import Reply


@pytest.mark.parametrize(
    ("status", "etype"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
        (504, "api_error"),
    ],
)
def test_proxy_errors_become_anthropic(status, etype) -> None:
    reply = error_reply(status, "what went wrong", code="x", headers={"Retry-After": "1"})
    to_anthropic(reply)
    assert reply.status == status
    assert msgspec.json.decode(reply.body) == {
        "type": "error",
        "error": {"type": etype, "message": "what went wrong"},
    }
    assert ("Retry-After", "1") in reply.headers
    assert [v for k, v in reply.headers if k == "Content-Type"] == ["application/json"]


def test_engine_anthropic_body_keeps_its_message_and_successes_are_untouched() -> None:
    body = b'{"type":"error","error":{"type":"BadRequestError","message":"bad max_tokens"}}'
    reply = Reply(400, [], body)
    to_anthropic(reply)
    assert msgspec.json.decode(reply.body)["error"] == {
        "type": "invalid_request_error",
        "message": "bad max_tokens",
    }
    ok = Reply(200, [], b'{"id":"msg_1"}')
    to_anthropic(ok)
    assert ok.body == b'{"id":"msg_1"}'
    empty = Reply(502, [], b"")
    to_anthropic(empty)
    assert msgspec.json.decode(empty.body)["error"]["type"] == "api_error"


def test_stream_error_event_rewritten() -> None:
    before = b"event: content_block_delta\ndata: {}\n\n"
    data = before + sse_error_event("engine broke", code="upstream_error")
    out = sse_error_to_anthropic(data)
    assert out == before + anthropic_sse_error("engine broke")
    assert out.endswith(b"\n\n") and b"event: error\ndata: " in out
    assert sse_error_to_anthropic(before) == before
