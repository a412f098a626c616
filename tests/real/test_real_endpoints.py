"""vLLM's tokenizer endpoints and model list through the real proxy, against the real engines.

The proxy routes ``/tokenize`` and ``/detokenize`` to the least-loaded engine and answers
``GET /v1/models`` from the engines' own lists (their ``max_model_len`` included).
"""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

import openai
import pytest
import real_harness as rh

pytestmark = [pytest.mark.real, pytest.mark.timeout(rh.READY_TIMEOUT_S + 300)]

#: How long the proxy may take to have asked every engine's /v1/models (its first round runs
#: at start; the rounds repeat every ``proxy.models_scrape_interval_s``, 15 s by default).
MODELS_WAIT_S = 40.0


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60.0) as resp:
        return resp.status, json.loads(resp.read()), dict(resp.headers)


def test_tokenize_detokenize_round_trip_through_the_proxy(
    proxy: rh.Running, vllm_engines: list[rh.Running]
) -> None:
    """The proxy's /tokenize is the engines' (same ids as asking one directly), /detokenize
    gives the prompt back, and the count is the prompt_tokens of a completion."""
    prompt = "tell me hello world"
    body = {"model": rh.MODEL, "prompt": prompt, "add_special_tokens": False}
    status, tok, headers = _post(proxy.url + "/tokenize", body)
    assert status == 200 and headers["x-fastroute-engine"] in ("vllm-0", "vllm-1")
    _, direct, _ = _post(vllm_engines[0].url + "/tokenize", body)
    assert tok["tokens"] == direct["tokens"] and tok["count"] == len(tok["tokens"]) > 0
    assert tok["max_model_len"] == rh.MAX_MODEL_LEN
    status, detok, _ = _post(
        proxy.url + "/detokenize", {"model": rh.MODEL, "tokens": tok["tokens"]}
    )
    assert status == 200 and detok["prompt"].strip() == prompt
    with openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0) as api:
        done = api.completions.create(
            model=rh.MODEL, prompt=prompt, max_tokens=1, extra_body={"add_special_tokens": False}
        )
    assert done.usage.prompt_tokens == tok["count"]


def test_models_come_from_the_engines(proxy: rh.Running) -> None:
    """GET /v1/models through the proxy is the engines' card: owned_by vllm, max_model_len."""
    deadline = time.monotonic() + MODELS_WAIT_S
    with openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0) as api:
        while True:
            models = api.models.list()
            if (models.data and models.data[0].owned_by == "vllm") or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    assert [m.id for m in models.data] == [rh.MODEL]
    card = models.data[0]
    assert card.owned_by == "vllm"
    assert card.max_model_len == rh.MAX_MODEL_LEN
