"""P/D protocol config: ``engines[].bootstrap_port`` and the protocol from the engines' kind."""

from __future__ import annotations

import pytest

from fastroute.config import (
    DEFAULT_BOOTSTRAP_PORT,
    ConfigError,
    bootstrap_port_of,
    decode_config,
    pd_protocol_of,
)


def _pair(p_kind: str, d_kind: str, p_extra: str = "", d_extra: str = "") -> str:
    return f"""
[[engines]]
name = "p"
url = "http://10.0.0.1:30000"
models = ["m"]
role = "prefill"
kind = "{p_kind}"
{p_extra}

[[engines]]
name = "d"
url = "http://10.0.0.2:30000"
models = ["m"]
role = "decode"
kind = "{d_kind}"
{d_extra}
"""


def _error(text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        decode_config(text)
    return info.value


def test_sglang_pair_uses_the_bootstrap_protocol_and_sglangs_default_port() -> None:
    config = decode_config(_pair("sglang", "sglang"))
    prefill = config.engines[0]
    assert prefill.bootstrap_port is None
    assert bootstrap_port_of(prefill) == DEFAULT_BOOTSTRAP_PORT == 8998
    assert pd_protocol_of(e.kind for e in config.engines) == "bootstrap"
    config = decode_config(_pair("sglang", "sglang", p_extra="bootstrap_port = 9100"))
    assert bootstrap_port_of(config.engines[0]) == 9100


def test_vllm_pair_keeps_the_nixl_protocol() -> None:
    config = decode_config(_pair("vllm", "vllm"))
    assert pd_protocol_of(e.kind for e in config.engines) == "nixl"


def test_a_pair_mixing_sglang_with_another_kind_is_an_error() -> None:
    error = _error(_pair("sglang", "vllm"))
    assert error.path == "$.engines[1].kind"
    assert "mixes P/D protocols" in str(error) and "'sglang'" in str(error)
    # the path names the first engine not of kind sglang
    assert _error(_pair("vllm", "sglang")).path == "$.engines[0].kind"


@pytest.mark.parametrize(
    ("text", "path"),
    [
        (_pair("vllm", "vllm", p_extra="bootstrap_port = 9100"), "$.engines[0].bootstrap_port"),
        (
            _pair("sglang", "sglang", d_extra="bootstrap_port = 9100"),
            "$.engines[1].bootstrap_port",
        ),
    ],
)
def test_bootstrap_port_only_on_sglang_prefill_engines(text: str, path: str) -> None:
    error = _error(text)
    assert error.path == path
    assert "bootstrap_port is for SGLang prefill engines" in str(error)


@pytest.mark.parametrize("port", [0, 65536])
def test_bootstrap_port_is_a_port_number(port: int) -> None:
    error = _error(_pair("sglang", "sglang", p_extra=f"bootstrap_port = {port}"))
    assert error.path == "$.engines[0].bootstrap_port"
