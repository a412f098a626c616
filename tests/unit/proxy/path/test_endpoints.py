"""The engine endpoint table: paths, parses, body limits and pass-through rules."""

from __future__ import annotations

import msgspec
import pytest

from fastroute.config import Config, decode_config
from fastroute.proxy.path.endpoint_handler import ENDPOINT_KINDS, EndpointHandler
from fastroute.proxy.path.endpoints import (
    ENDPOINTS,
    PASSTHROUGH,
    endpoint_for,
    parse_form_model,
    parse_json_model,
    passthrough_allows,
)
from fastroute.proxy.path.handler import InferenceHandler
from fastroute.proxy.path.requests import RequestParseError

#: vLLM 0.32's routes the proxy routes by model.
VLLM_ROUTED = {
    "/tokenize": "tokenizer",
    "/detokenize": "tokenizer",
    "/pooling": "pooling",
    "/classify": "pooling",
    "/score": "pooling",
    "/v1/score": "pooling",
    "/rerank": "pooling",
    "/v1/rerank": "pooling",
    "/v2/rerank": "pooling",
    "/v1/audio/transcriptions": "audio",
    "/v1/audio/translations": "audio",
}


def _config(extra: str = "") -> Config:
    toml = (
        '[[engines]]\nname = "e0"\nurl = "http://127.0.0.1:1"\nmodels = ["m"]\n'
        f"[proxy]\n{extra}\n[limits]\nmax_body_bytes = 2048\nmax_audio_body_bytes = 8192\n"
    )
    return decode_config(toml, source="t.toml")


def test_table_is_vllms_list() -> None:
    assert {p: e.kind for p, e in ENDPOINTS.items()} == VLLM_ROUTED
    assert set(ENDPOINT_KINDS) == {"tokenizer", "pooling", "audio", "passthrough"}
    # None of them takes the P/D path; of the chat handler's kinds, embeddings and the
    # Responses/Messages APIs (whose bodies a P/D stage cannot rewrite) do not either.
    assert EndpointHandler.whole_only_kinds == frozenset(ENDPOINT_KINDS)
    assert InferenceHandler.whole_only_kinds == frozenset(
        {"embeddings", "responses", "messages", "count_tokens"}
    )


def test_body_limits() -> None:
    config = _config()
    assert ENDPOINTS["/v1/audio/translations"].body_limit(config) == (
        8192,
        "limits.max_audio_body_bytes",
    )
    assert ENDPOINTS["/rerank"].body_limit(config) == (2048, "limits.max_body_bytes")


def test_json_parse() -> None:
    parsed = parse_json_model(b'{"model": "m", "user": "u", "prompt": "x", "tokens": [1]}', {})
    assert (parsed.model, parsed.user, parsed.prompt) == ("m", "u", "")
    assert parse_json_model(b"{}", {}).model is None
    for bad in (b"[1]", b'{"model": 3}', b"{"):
        with pytest.raises(RequestParseError):
            parse_json_model(bad, {})


def test_form_parse() -> None:
    body = b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper\r\n--b--\r\n'
    headers = {"Content-Type": "multipart/form-data; boundary=b"}
    assert parse_form_model(body, headers).model == "whisper"
    with pytest.raises(RequestParseError, match="multipart/form-data"):
        parse_form_model(body, {"Content-Type": "application/json"})


def test_passthrough_rules() -> None:
    paths = ("/v1/exact", "/v1/prefix/")
    assert passthrough_allows(paths, "/v1/exact")
    assert not passthrough_allows(paths, "/v1/exact/more")
    assert passthrough_allows(paths, "/v1/prefix/a/b")
    assert not passthrough_allows(paths, "/v1/prefix")
    assert not passthrough_allows(paths, "/v1/prefix/../admin")
    assert not passthrough_allows(paths, "/v1/prefix/./x")
    assert not passthrough_allows((), "/v1/exact")


def test_endpoint_for() -> None:
    plain = _config()
    assert endpoint_for("/tokenize", plain) is ENDPOINTS["/tokenize"]
    assert endpoint_for("/v1/custom", plain) is None
    allowing = _config('passthrough_paths = ["/v1/custom", "/v1/lora/"]')
    assert endpoint_for("/v1/custom", allowing) is PASSTHROUGH
    assert endpoint_for("/v1/lora/load", allowing) is PASSTHROUGH
    assert endpoint_for("/v2/custom", allowing) is None


@pytest.mark.parametrize("bad", ["/admin/x", "/v1/a b", "v1/x", "/v1"])
def test_passthrough_paths_are_validated(bad: str) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"passthrough_paths": [bad]}, type(_config().proxy))
