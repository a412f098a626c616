"""Routing key: minimal request parse, key precedence, canonical conversation prefixes."""

from __future__ import annotations

import msgspec
import pytest
from multidict import CIMultiDict

from fastroute.errors import FastrouteError
from fastroute.hashing import key_hash
from fastroute.proxy.path.requests import RequestParseError, parse_chat, parse_completion
from fastroute.proxy.path.routing_key import (
    PROMPT_KEY_PREFIX_BYTES,
    PROMPT_KEY_PREFIX_TOKENS,
    KeySource,
    conversation_key_bytes,
    estimate_prompt_tokens,
    routing_key,
)

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


def chat(*messages: dict[str, object], **fields: object) -> bytes:
    return msgspec.json.encode({"model": "m", "messages": list(messages), **fields})


def chat_key(body: bytes, headers: dict[str, str] | None = None) -> tuple[int, str]:
    return routing_key(parse_chat(body), headers or {})


def completion_key(prompt: object) -> tuple[int, str]:
    return routing_key(parse_completion(msgspec.json.encode({"prompt": prompt})), {})


def user(text: object) -> dict[str, object]:
    return {"role": "user", "content": text}


# -- precedence ---------------------------------------------------------------------------


def test_precedence_header_then_cache_key_then_user_then_conversation() -> None:
    """Each source wins over every later one, and identifiers hash as themselves."""
    body = chat(SYSTEM, user("hi"), user="alice", prompt_cache_key="pck")
    assert chat_key(body, {"x-session-id": "s-1"}) == (key_hash("s-1"), "header")
    assert chat_key(body) == (key_hash("pck"), "prompt_cache_key")
    assert chat_key(chat(SYSTEM, user("hi"), user="alice")) == (key_hash("alice"), "user")
    h, source = chat_key(chat(SYSTEM, user("hi")))
    assert source == KeySource.CONVERSATION and h not in (key_hash("alice"), key_hash("s-1"))


def test_session_header_is_case_insensitive_configurable_and_blank_ignored() -> None:
    """aiohttp-style headers match any case; blank values and blank fields fall through."""
    parsed = parse_chat(chat(SYSTEM, user("hi"), user="  "))
    headers = CIMultiDict({"X-Session-Id": " s-9 "})
    assert routing_key(parsed, headers) == (key_hash("s-9"), "header")
    assert routing_key(parsed, {"x-conv": "c"}, session_header="X-Conv") == (
        key_hash("c"),
        "header",
    )
    assert routing_key(parsed, {"x-session-id": "   "})[1] == "conversation"


def test_golden_keys() -> None:
    """The canonical forms are frozen: every data plane, in every version, agrees on keys."""
    parsed = parse_chat(chat(SYSTEM, user("Hello")))
    # tag, then per message: len(role) role, kind byte "s" (text), len(content) content;
    # lengths are 8-byte little-endian.
    assert conversation_key_bytes(parsed) == (
        b"\0chat\0"
        b"\x06\0\0\0\0\0\0\0system"
        b"s"
        b"\x1c\0\0\0\0\0\0\0You are a helpful assistant."
        b"\x04\0\0\0\0\0\0\0user"
        b"s"
        b"\x05\0\0\0\0\0\0\0Hello"
    )
    assert routing_key(parsed, {}) == (0x4B718F3274BA2457, "conversation")
    assert completion_key("Once upon a time") == (0xEEAE0C1987002DD0, "prompt")
    assert completion_key([1, 2, 3]) == (0xB4EA890B15D05FBF, "prompt")


# -- conversations ------------------------------------------------------------------------


def test_later_turns_of_a_conversation_keep_the_key() -> None:
    """Appending assistant/user/tool turns never changes the key."""
    first = chat_key(chat(SYSTEM, user("Plan a trip to Lisbon")))
    later = chat_key(
        chat(
            SYSTEM,
            user("Plan a trip to Lisbon"),
            {"role": "assistant", "content": None, "tool_calls": [{"id": "t1"}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "t1"},
            {"role": "assistant", "content": "Day 1: Alfama."},
            user("And day 2?"),
            max_completion_tokens=100,
            stream=True,
        )
    )
    assert later == first


def test_conversations_sharing_only_the_system_prompt_get_different_keys() -> None:
    """The first user message is part of the key; the system prompt alone never is."""
    a = chat_key(chat(SYSTEM, user("What is HRW hashing?")))
    b = chat_key(chat(SYSTEM, user("Write a haiku")))
    c = chat_key(chat({"role": "system", "content": "Be terse."}, user("Write a haiku")))
    assert len({a, b, c}) == 3
    # A chat with no user message has nothing conversation-specific to key on.
    assert chat_key(chat(SYSTEM)) == (0, "none")
    parsed = parse_chat(chat(SYSTEM))
    assert routing_key(parsed, {}, request_id="req-7") == (key_hash("req-7"), "request_id")


def test_multimodal_content_parts() -> None:
    """Text-only part lists key like the joined string; images are part of the key."""
    as_string = chat_key(chat(SYSTEM, user("look\nhere")))
    as_parts = chat_key(
        chat(SYSTEM, user([{"type": "text", "text": "look"}, {"type": "text", "text": "here"}]))
    )
    assert as_parts == as_string

    def with_image(url: object) -> tuple[int, str]:
        return chat_key(
            chat(
                SYSTEM,
                user(
                    [
                        {"type": "text", "text": "What is this?"},
                        {"type": "image_url", "image_url": url},
                    ]
                ),
            )
        )

    cat = with_image({"url": "https://example.com/cat.png", "detail": "high"})
    dog = with_image({"url": "https://example.com/dog.png"})
    assert cat != dog and cat[1] == "conversation"
    assert with_image("https://example.com/cat.png") == cat  # bare-string form, same URL
    audio = chat_key(
        chat(user([{"type": "input_audio", "input_audio": {"data": "UklGR", "format": "wav"}}]))
    )
    assert audio[1] == "conversation" and audio != chat_key(chat(user("")))


# -- completions --------------------------------------------------------------------------


def test_text_prompts_key_on_their_prefix() -> None:
    """Prompts equal in the first PROMPT_KEY_PREFIX_BYTES bytes share a key; a batch keys on
    its first prompt."""
    head = "x" * (PROMPT_KEY_PREFIX_BYTES - 1)
    assert completion_key(head + "a" + "tail one") == completion_key(head + "a" + "tail two")
    assert completion_key(head + "a") != completion_key(head + "b")
    assert completion_key([head + "a", "other"]) == completion_key(head + "a")
    assert completion_key("")[1] == "none" and completion_key([])[1] == "none"
    # A multi-byte character cut by the prefix is still deterministic.
    assert completion_key("é" * PROMPT_KEY_PREFIX_BYTES)[1] == "prompt"


def test_token_id_prompts() -> None:
    """Token-id prompts key on their first PROMPT_KEY_PREFIX_TOKENS ids, apart from text."""
    ids = list(range(PROMPT_KEY_PREFIX_TOKENS))
    assert completion_key([*ids, 1]) == completion_key([*ids, 2])
    assert completion_key([0, 1]) != completion_key([0, 2])
    assert completion_key([[5, 6], [7]]) == completion_key([5, 6])
    assert completion_key([1, 2, 3])[1] == "prompt"
    assert completion_key("[1,2,3]") != completion_key([1, 2, 3])


# -- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "path", "fragment"),
    [
        (b'{"messages": [', None, "truncated"),
        (b"\xff", None, "malformed"),
        (b"[]", "$", "Expected `object`"),
        (b'{"model": "m"}', "$.messages", "missing required field `messages`"),
        (b'{"messages": [{"role": 1}]}', "$.messages[0].role", "Expected `str`"),
        (b'{"messages": [], "stream": "yes"}', "$.stream", "Expected `bool | null`"),
        (b'{"messages": [], "max_tokens": 1.5}', "$.max_tokens", "Expected `int | null`"),
        (
            b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
            "$.messages[0].content[0].text",
            "Expected `str | null`",
        ),
    ],
)
def test_malformed_chat_bodies_raise_with_a_path(
    body: bytes, path: str | None, fragment: str
) -> None:
    """Malformed JSON or wrong types raise RequestParseError naming the JSON path."""
    with pytest.raises(RequestParseError, match=fragment) as info:
        parse_chat(body)
    err = info.value
    assert isinstance(err, FastrouteError) and isinstance(err, ValueError)
    assert err.path == path and err.status == 400
    if path is not None:
        assert f"at `{path}`" in err.message
    body_json = err.to_openai_error()["error"]
    assert body_json["type"] == "invalid_request_error"
    assert body_json["param"] == (path[2:] if path and path != "$" else None)


@pytest.mark.parametrize(
    ("prompt", "path"),
    [
        ({"a": 1}, "$.prompt"),
        ([1, "a"], "$.prompt[1]"),
        ([[1], 2], "$.prompt[1]"),
        ([True], "$.prompt[0]"),
    ],
)
def test_malformed_prompts_raise_with_a_path(prompt: object, path: str) -> None:
    """Prompts of the wrong type, or mixing shapes, raise RequestParseError at the element."""
    with pytest.raises(RequestParseError) as info:
        parse_completion(msgspec.json.encode({"prompt": prompt}))
    assert info.value.path == path


# -- token estimate -----------------------------------------------------------------------


def test_estimate_prompt_tokens() -> None:
    """bytes/4 per text, a template overhead per message, a fixed count per image."""
    assert estimate_prompt_tokens(parse_completion(b'{"prompt": "abcdefgh"}')) == 2
    assert estimate_prompt_tokens(parse_completion(b'{"prompt": "abcdefghi"}')) == 3
    assert estimate_prompt_tokens(parse_completion(b'{"prompt": [1, 2, 3]}')) == 3
    assert estimate_prompt_tokens(parse_completion(b'{"prompt": [[1, 2], [3]]}')) == 3
    assert estimate_prompt_tokens(parse_completion(b'{"prompt": ["abcd", "ab"]}')) == 2
    parsed = parse_chat(
        chat(
            {"role": "system", "content": "x" * 40},
            user([{"type": "text", "text": "é" * 4}, {"type": "image_url", "image_url": "u"}]),
        )
    )
    assert estimate_prompt_tokens(parsed) == (4 + 10) + (4 + 2 + 576)
    assert parsed.max_output_tokens is None
    assert parse_chat(chat(user("a"), max_tokens=5)).max_output_tokens == 5
    assert parse_chat(chat(user("a"), max_tokens=5, max_completion_tokens=7)).max_output_tokens == 7
