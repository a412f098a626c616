"""Classification in isolation: what a request's state holds after it, and each refusal."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from fastroute.config import decode_config
from fastroute.proxy.path.classify import PREFIX_BYTES, Classifier, Reject, route_prefix
from fastroute.proxy.path.decisions import DecisionRecord
from fastroute.proxy.path.fleet import Fleet
from fastroute.proxy.path.request_state import RequestState
from fastroute.proxy.path.requests import parse_chat, parse_completion

_CONFIG = (
    '[[engines]]\nname = "e0"\nurl = "http://127.0.0.1:9000"\nmodels = ["m"]\nzone = "us"\n\n'
    '[[engines]]\nname = "e1"\nurl = "http://127.0.0.1:9001"\nmodels = ["m"]\nzone = "eu"\n\n'
    '[[tenants]]\nname = "acme"\napi_keys = ["sk-acme"]\ndefault_priority = "batch"\n'
    'zones = ["eu"]\n'
    '[[network.regions]]\nname = "local"\nzone = "us"\n'
    '[[network.regions]]\nname = "eu-west"\nzone = "eu"\n'
    "[network.rtt_ms]\nlocal = { eu-west = 80.0 }\n"
)


class _Request:
    path = "/v1/completions"

    def __init__(self, **headers: str) -> None:
        self.headers = CIMultiDict(headers)
        self.raw_headers = [(k.encode(), v.encode()) for k, v in headers.items()]


def _classify(body: bytes, **headers: str) -> RequestState:
    config = decode_config(_CONFIG)
    classifier = Classifier(config, Fleet(config).rows)
    record = DecisionRecord(request_id="r1", endpoint="/v1/completions")
    state = RequestState(_Request(**headers), "completions", body, None, record, None, 0.0)  # type: ignore[arg-type]
    state.parsed = classifier.parse("completions", body)
    classifier.classify(state)
    return state


def test_a_tenants_request_gets_its_priority_zones_class_and_row() -> None:
    state = _classify(b'{"model": "m", "prompt": "hi"}', Authorization="Bearer sk-acme")
    assert (state.model, state.priority, state.tenant) == ("m", "batch", "acme")
    assert state.zones == frozenset({"eu"}) and state.hardware is None
    assert state.cls is not None and state.cls.name == "m/batch"
    assert state.row == Fleet(decode_config(_CONFIG)).rows[("m", "batch")]


@pytest.mark.parametrize(
    ("body", "headers", "status", "code"),
    [
        (b'{"model": "m"', {"Authorization": "Bearer sk-acme"}, 400, None),
        (b'{"prompt": "hi"}', {"Authorization": "Bearer sk-acme"}, 400, "missing_model"),
        (b'{"model": "m", "prompt": "hi"}', {}, 401, "invalid_api_key"),
        (
            b'{"model": "m", "prompt": "hi"}',
            {"Authorization": "Bearer sk-acme", "x-fastroute-zone": "us"},
            403,
            "zone_not_allowed",
        ),
        (
            b'{"model": "m", "prompt": "hi"}',
            {"Authorization": "Bearer sk-acme", "x-fastroute-priority": "urgent"},
            400,
            "invalid_priority",
        ),
        (b'{"model": "x", "prompt": "hi"}', {"Authorization": "Bearer sk-acme"}, 404, None),
    ],
)
def test_each_refusal_carries_its_response(
    body: bytes, headers: dict[str, str], status: int, code: str | None
) -> None:
    with pytest.raises(Reject) as info:
        _classify(body, **headers)
    assert info.value.response.status == status
    assert info.value.reason.startswith(f"rejected before routing (HTTP {status}): ")
    if code is not None:
        assert f'"code":"{code}"'.encode() in info.value.response.body


def test_route_prefix_is_the_leading_prompt_text_capped() -> None:
    chat = parse_chat(b'{"model": "m", "messages": [{"role": "user", "content": "hello"}]}')
    assert route_prefix(chat) == b"hello"
    long = parse_completion(b'{"model": "m", "prompt": "%s"}' % (b"x" * (PREFIX_BYTES + 9)))
    assert route_prefix(long) == b"x" * PREFIX_BYTES
    assert route_prefix(parse_completion(b'{"model": "m", "prompt": [1, 2]}')) == b""
