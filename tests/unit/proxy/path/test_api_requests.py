"""Responses and Messages bodies parse to the chat request they stand for: same routing
key, route prefix and prompt estimate as the equivalent chat body."""

from __future__ import annotations

import msgspec
import pytest

from fastroute.proxy.path.api_requests import ResponsesChat, parse_messages, parse_responses
from fastroute.proxy.path.classify import route_prefix
from fastroute.proxy.path.requests import RequestParseError, parse_chat
from fastroute.proxy.path.routing_key import KeySource, estimate_prompt_tokens, routing_key

_enc = msgspec.json.encode
CHAT = _enc(
    {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "Hello there"},
        ],
    }
)


def _same_as_chat(parsed: object) -> None:
    chat = parse_chat(CHAT)
    assert routing_key(parsed, {}) == routing_key(chat, {})
    assert routing_key(parsed, {})[1] == KeySource.CONVERSATION
    assert route_prefix(parsed) == route_prefix(chat)
    assert estimate_prompt_tokens(parsed) == estimate_prompt_tokens(chat)


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "instructions": "Be terse.", "input": "Hello there"},
        {
            "model": "m",
            "instructions": "Be terse.",
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}],
        },
        {
            "model": "m",
            "input": [
                {"type": "message", "role": "system", "content": "Be terse."},
                {"type": "message", "role": "user", "content": "Hello there"},
            ],
        },
    ],
    ids=["string", "parts", "items"],
)
def test_responses_body_keys_like_chat(body) -> None:
    _same_as_chat(parse_responses(_enc(body)))


@pytest.mark.parametrize(
    "system",
    ["Be terse.", [{"type": "text", "text": "Be terse."}]],
    ids=["string", "blocks"],
)
def test_messages_body_keys_like_chat(system) -> None:
    body = {
        "model": "m",
        "max_tokens": 5,
        "system": system,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}],
    }
    parsed = parse_messages(_enc(body))
    assert parsed.max_output_tokens == 5
    _same_as_chat(parsed)


def test_responses_fields_routing_reads() -> None:
    parsed = parse_responses(
        _enc(
            {
                "model": "m",
                "input": [
                    {"role": "user", "content": "q"},
                    {"type": "function_call_output", "call_id": "c1", "output": {"ok": True}},
                ],
                "previous_response_id": "resp_1",
                "max_output_tokens": 7,
                "stream": True,
                "user": "u",
            }
        )
    )
    assert isinstance(parsed, ResponsesChat)
    assert parsed.previous_response_id == "resp_1"
    assert (parsed.max_output_tokens, parsed.stream, parsed.user) == (7, True, "u")
    assert parsed.messages[1].role == "function_call_output"
    assert parsed.messages[1].content == '{"ok":true}'


def test_messages_blocks_and_user() -> None:
    parsed = parse_messages(
        _enc(
            {
                "model": "m",
                "max_tokens": 1,
                "metadata": {"user_id": "alice"},
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": "AAA",
                                },
                            },
                            {
                                "type": "tool_result",
                                "tool_use_id": "t",
                                "content": [{"type": "text", "text": "42"}],
                            },
                        ],
                    }
                ],
            }
        )
    )
    assert parsed.user == "alice"
    parts = parsed.messages[0].content
    assert parts[0].image_url == "data:image/png;base64,AAA"
    assert (parts[1].type, parts[1].text) == ("text", "42")


@pytest.mark.parametrize(
    ("parse", "body", "param"),
    [
        (parse_messages, b'{"model":"m","max_tokens":1}', "messages"),
        (parse_messages, b'{"model":"m","messages":"x"}', "messages"),
        (parse_responses, b'{"model":"m","input":5}', "input"),
        (parse_responses, b"{not json", None),
    ],
)
def test_malformed_bodies_name_the_field(parse, body, param) -> None:
    with pytest.raises(RequestParseError) as err:
        parse(body)
    assert err.value.param == param
