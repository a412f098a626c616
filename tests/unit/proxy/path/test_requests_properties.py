"""Property tests of the request parsers and the routing key (hypothesis).

Any bytes a client sends are either a parsed request or a ``RequestParseError`` (the
400), never another exception; a routing key is deterministic and does not depend on
the JSON key order of the body.
"""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from fastroute.proxy.path.api_requests import parse_messages, parse_responses
from fastroute.proxy.path.classify import parse_embeddings
from fastroute.proxy.path.endpoints import parse_json_model
from fastroute.proxy.path.requests import RequestParseError, parse_chat, parse_completion
from fastroute.proxy.path.routing_key import estimate_prompt_tokens, routing_key

PARSERS = (parse_chat, parse_completion, parse_responses, parse_messages, parse_embeddings)

_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)
_roles = st.sampled_from(["user", "system", "assistant", "tool", ""])
_content = st.text(max_size=20) | st.lists(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}), max_size=3
)
_message = st.fixed_dictionaries({"role": _roles, "content": _content})
_chat_body = st.fixed_dictionaries(
    {"model": st.text(max_size=8), "messages": st.lists(_message, min_size=1, max_size=4)},
    optional={"user": st.text(max_size=8), "max_tokens": st.integers(0, 10**6), "x": _json_values},
)


def _parses_or_400(parser, body: bytes) -> None:
    try:
        parser(body)
    except RequestParseError as exc:
        assert str(exc).startswith("Invalid request body")


@given(st.binary(max_size=200))
def test_random_bytes_parse_or_get_a_request_error(body: bytes) -> None:
    for parser in PARSERS:
        _parses_or_400(parser, body)
    _parses_or_400(lambda b: parse_json_model(b, {}), body)


@given(_json_values, st.sampled_from(["messages", "prompt", "input", "model", "x"]))
def test_any_json_document_parses_or_gets_a_request_error(value: object, field: str) -> None:
    body = json.dumps({"model": "m", field: value}).encode()
    for parser in PARSERS:
        _parses_or_400(parser, body)


@given(st.integers(1, 200_000), st.sampled_from(["[", '{"a":']))
def test_any_nesting_depth_parses_or_gets_a_request_error(depth: int, opener: str) -> None:
    closer = "]" if opener == "[" else "}"
    head = b'{"model":"m","messages":[],"prompt":"p","input":"i","x":'
    body = head + opener.encode() * depth + b"1" + closer.encode() * depth + b"}"
    for parser in PARSERS:
        _parses_or_400(parser, body)


@given(_chat_body, st.randoms(use_true_random=False))
def test_routing_key_is_deterministic_and_independent_of_key_order(body: dict, rnd) -> None:
    items = list(body.items())
    rnd.shuffle(items)
    a = parse_chat(json.dumps(body).encode())
    b = parse_chat(json.dumps(dict(items)).encode())
    headers: dict[str, str] = {}
    assert routing_key(a, headers, request_id="r") == routing_key(b, headers, request_id="r")
    assert routing_key(a, headers, request_id="r") == routing_key(a, headers, request_id="r")
    assert estimate_prompt_tokens(a) == estimate_prompt_tokens(b) >= 0
