"""The bodies of SGLang's P/D protocol: the client's request plus the bootstrap fields."""

from __future__ import annotations

import msgspec

from fastroute.config import EngineConfig
from fastroute.proxy.path.pd_bootstrap import bootstrap_address, bootstrap_body
from fastroute.proxy.path.pd_usage import stream_cached_tokens


def test_body_is_the_request_plus_the_three_bootstrap_fields() -> None:
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
               "max_tokens": 7, "min_tokens": 3}  # fmt: skip
    body = msgspec.json.decode(bootstrap_body(request, "10.0.0.1", 8998, 2**63 - 1))
    assert body == {**request, "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998,
                    "bootstrap_room": 2**63 - 1}  # fmt: skip
    assert "bootstrap_room" not in request  # the client's request is not changed


def test_bootstrap_address_is_the_engine_host_and_its_bootstrap_port() -> None:
    engine = EngineConfig(name="p", url="http://[fd00::1]:30000", models=("m",), kind="sglang",
                          role="prefill")  # fmt: skip
    assert bootstrap_address(engine) == ("fd00::1", 8998)
    engine = EngineConfig(name="p", url="http://Prefill.local:30000", models=("m",),
                          kind="sglang", role="prefill", bootstrap_port=9001)  # fmt: skip
    assert bootstrap_address(engine) == ("prefill.local", 9001)


def test_stream_cached_tokens_reads_the_last_usage_event() -> None:
    usage = b'{"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":4}}}'
    events = b'data: {"choices":[{"text":"a"}]}\n\ndata: ' + usage + b"\n\ndata: [DONE]\n\n"
    assert stream_cached_tokens(events) == 4
    assert stream_cached_tokens(b'data: {"choices":[]}\n\ndata: [DONE]\n\n') is None
