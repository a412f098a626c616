"""fastroute in front of two real vLLM engines (CPU build, a tiny random-weight Llama).

The official ``openai`` client talks to the real proxy (``fastroute serve``), which relays to
the real engines: chat and completions, JSON and streamed; the engines' errors reach the client
in OpenAI shape; the engines' ``/metrics`` read by fastroute's scraper. Random weights say
nothing sensible, so requests pin their length with ``ignore_eos`` and check counts, not text.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import real_harness as rh

from fastroute.config import EngineConfig
from fastroute.signals.scrape import EngineScraper

pytestmark = [pytest.mark.real, pytest.mark.timeout(rh.READY_TIMEOUT_S + 300)]

PINNED = {"ignore_eos": True}  # vLLM's sampling extra: exactly max_tokens tokens
# Over 128 tokens (one CPU KV block) of shared prefix, so a second request hits the cache.
SHARED_PREFIX = " ".join(["tell me hello world"] * 60)


def client(run: rh.Running) -> openai.OpenAI:
    """A sync client without retries (close it: ``with client(run) as c``)."""
    return openai.OpenAI(base_url=run.url + "/v1", api_key="x", max_retries=0, timeout=60.0)


@pytest.fixture
def api(proxy: rh.Running) -> Iterator[openai.OpenAI]:
    """A client of the proxy, closed after the test."""
    with client(proxy) as c:
        yield c


def test_chat_json(api: openai.OpenAI) -> None:
    reply = api.chat.completions.create(
        model=rh.MODEL,
        messages=[{"role": "user", "content": "hello world"}],
        max_tokens=5,
        extra_body=PINNED,
    )
    assert reply.object == "chat.completion" and reply.model == rh.MODEL
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert choice.message.content
    assert reply.usage is not None and reply.usage.completion_tokens == 5
    assert reply.usage.prompt_tokens > 0


def test_chat_stream_with_usage(api: openai.OpenAI) -> None:
    stream = api.chat.completions.create(
        model=rh.MODEL,
        messages=[{"role": "user", "content": "hello world"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=PINNED,
    )
    chunks = list(stream)
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert with_choices[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text.strip()
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage is not None and usage.completion_tokens == 6


def test_completions_json_and_stream(api: openai.OpenAI) -> None:
    c = api
    reply = c.completions.create(model=rh.MODEL, prompt="hello", max_tokens=4, extra_body=PINNED)
    assert reply.object == "text_completion" and reply.choices[0].text
    assert reply.usage is not None and reply.usage.completion_tokens == 4
    chunks = list(
        c.completions.create(
            model=rh.MODEL,
            prompt="hello",
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=PINNED,
        )
    )
    texts = [ch.choices[0].text for ch in chunks if ch.choices]
    # vLLM's output collector merges the deltas a slow consumer has not read yet (one event
    # can carry all 4 tokens on a busy CPU), so the event count is 1..4, never more
    assert 1 <= len(texts) <= 4 and all(texts)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


def test_shared_prefix_hits_the_cache_of_the_same_engine(api: openai.OpenAI) -> None:
    """Two requests of one session go to one engine; the second reuses the first's 128-token
    KV block, and says so in ``cached_tokens`` (``--enable-prompt-tokens-details``)."""
    c = api
    cached = []
    for i in range(2):
        reply = c.completions.create(
            model=rh.MODEL,
            prompt=f"{SHARED_PREFIX} number {i}",
            max_tokens=2,
            extra_body=PINNED,
            extra_headers={"x-session-id": "real-prefix"},
        )
        assert reply.usage is not None and reply.usage.prompt_tokens > 128
        details = reply.usage.prompt_tokens_details
        assert details is not None
        cached.append(details.cached_tokens)
    assert cached[1] is not None and cached[1] >= 128 and cached[1] % 128 == 0


def test_too_long_prompt_is_the_engines_bad_request(
    api: openai.OpenAI, vllm_engines: list[rh.Running]
) -> None:
    """Through the proxy: vLLM's 400, message, type and param. (vLLM's ``code`` is the HTTP
    status as an integer, as the engine itself shows; today's proxy passes string codes only.)"""
    long_prompt = " ".join(["hello world"] * 700)  # > 1024 tokens
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model=rh.MODEL, prompt=long_prompt, max_tokens=4)
    err = info.value
    assert err.status_code == 400
    assert "maximum context length is 1024 tokens" in err.message
    body: Any = err.body
    assert body["type"] == "BadRequestError" and body["param"] == "input_tokens"
    with client(vllm_engines[0]) as direct, pytest.raises(openai.BadRequestError) as info:
        direct.completions.create(model=rh.MODEL, prompt=long_prompt, max_tokens=4)
    body = info.value.body
    assert body["code"] == 400 and body["param"] == "input_tokens"


def test_invalid_parameter_is_the_engines_bad_request(api: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(
            model=rh.MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            temperature=-1,
        )
    assert "temperature must be non-negative" in info.value.message
    body: Any = info.value.body
    assert body["param"] == "temperature" and body["type"] == "BadRequestError"


def test_unknown_model_is_not_found(api: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )


def test_engines_answer_directly_too(vllm_engines: list[rh.Running]) -> None:
    """Each engine serves on its own (so the proxy is what the other tests exercise)."""
    for engine in vllm_engines:
        with client(engine) as c:
            models = c.models.list()
        assert [m.id for m in models.data] == [rh.MODEL]
        assert models.data[0].owned_by == "vllm"


def test_scraper_reads_the_real_vllm_metrics(
    api: openai.OpenAI, vllm_engines: list[rh.Running]
) -> None:
    """fastroute's scraper reads both real engines' ``/metrics`` in the vLLM dialect."""
    api.chat.completions.create(
        model=rh.MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    engines = [
        EngineConfig(name=f"vllm-{i}", url=e.url, models=(rh.MODEL,), kind="vllm")
        for i, e in enumerate(vllm_engines)
    ]

    async def scrape() -> EngineScraper:
        scraper = EngineScraper(engines, timeout_s=10.0, health=True)
        try:
            await scraper.scrape_once()
        finally:
            await scraper.close()
        return scraper

    scraper = asyncio.run(scrape())
    served = generated = 0.0
    for result in scraper.results.values():
        assert result.error is None and result.healthy is True and not result.metrics_disabled
        assert result.by_model is not None and list(result.by_model) == [rh.MODEL]
        s = result.signals
        assert s is not None and s.scraped_at_s > 1e9
        assert s.num_requests_running is not None and s.num_requests_waiting is not None
        assert s.kv_cache_usage is not None and 0.0 <= s.kv_cache_usage <= 1.0
        assert s.prefix_cache_queries_total is not None and s.prefix_cache_hits_total is not None
        assert s.preemptions_total is not None
        assert s.generation_tokens_total is not None  # the reuse gain's decode count
        assert s.ttft_s is not None and s.itl_s is not None and s.e2e_s is not None
        served += s.e2e_s.count
        generated += s.generation_tokens_total
    assert served >= 1  # the request above finished on one of them
    assert generated >= 1


@pytest.mark.parametrize("client_usage", [False, True], ids=["no-usage", "usage"])
@pytest.mark.parametrize("interval", [1, 4])
def test_tbot_and_tokens_are_the_engines(
    proxy: rh.Running, interval: int, client_usage: bool
) -> None:
    """The proxy's TBOT and output length are within 10 % of vLLM's own (its usage, and
    the span of the text events the client saw), at 1 and 4 tokens per event; the usage
    event reaches only a client that asked for it."""
    body: dict[str, Any] = {
        "model": rh.MODEL,
        "messages": [{"role": "user", "content": "hello world"}],
        "max_tokens": 64,
        "stream": True,
        "stream_interval": interval,
        **PINNED,
    }
    if client_usage:
        body["stream_options"] = {"include_usage": True}
    events: list[tuple[float, Any]] = []
    post = urllib.request.Request(
        proxy.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(post, timeout=60.0) as resp:
        assert resp.status == 200
        rid = resp.headers["x-request-id"]
        for raw in resp:
            line = raw.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                events.append((time.monotonic(), json.loads(line[6:])))
    time.sleep(0.2)  # the record is complete once the proxy's handler returned
    with urllib.request.urlopen(proxy.url + f"/admin/decisions/{rid}", timeout=10.0) as resp:
        record = json.loads(resp.read())
    usage_events = [e for _, e in events if e.get("choices") == []]
    if client_usage:
        assert len(usage_events) == 1 and usage_events[0]["usage"]["completion_tokens"] == 64
    else:
        assert usage_events == [] and all(e.get("usage") is None for _, e in events)
    text_times = [
        t for t, e in events if e.get("choices") and e["choices"][0]["delta"].get("content")
    ]
    if interval == 4:
        assert len(text_times) < 20  # several tokens per event
    true_tbot = (text_times[-1] - text_times[0]) / 63
    attempt = record["attempts"][0]
    assert attempt["outcome"] == "success"
    assert attempt["output_tokens"] == pytest.approx(64, rel=0.10)
    assert record["timings"]["tbot_s"] == pytest.approx(true_tbot, rel=0.10)
