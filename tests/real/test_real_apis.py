"""The Responses API and Anthropic Messages through the real proxy to real vLLM engines.

The engines run with ``VLLM_ENABLE_RESPONSES_API_STORE=1`` (``real_harness.vllm_env``):
without it vLLM stores nothing and every ``previous_response_id`` is its 404. Random
weights say nothing sensible, so the checks are on shapes, counts and engines, not text.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
import real_harness as rh

pytestmark = [pytest.mark.real, pytest.mark.timeout(rh.READY_TIMEOUT_S + 300)]

#: The decision reason of a turn sent to the engine that stored the previous one.
PIN_REASON = "response-affinity"


@pytest.fixture
def api(proxy: rh.Running) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=60.0) as c:
        yield c


@pytest.fixture
def claude(proxy: rh.Running) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=proxy.url, api_key="x", max_retries=0, timeout=60.0) as c:
        yield c


def _record(proxy: rh.Running, rid: str) -> dict[str, Any]:
    time.sleep(0.2)  # the record is complete once the proxy's handler returned
    with urllib.request.urlopen(proxy.url + f"/admin/decisions/{rid}", timeout=10.0) as resp:
        return dict(json.loads(resp.read()))


def test_responses_three_turns_stay_on_the_storing_engine(
    api: openai.OpenAI, proxy: rh.Running
) -> None:
    """Three turns chained by ``previous_response_id``: every turn reaches the engine that
    stored the previous response (pinned), whose prompt holds the whole conversation;
    ``responses.retrieve`` finds the last one; an unknown id is vLLM's 404, relayed."""
    turns = []
    previous = None
    for i in range(3):
        raw = api.responses.with_raw_response.create(
            model=rh.MODEL,
            input=f"hello world, turn {i}",
            previous_response_id=previous,
            max_output_tokens=4,
        )
        resp = raw.parse()
        turns.append((resp, raw.headers["x-fastroute-engine"], raw.headers["x-fastroute-decision"]))
        previous = resp.id
    assert len({engine for _, engine, _ in turns}) == 1, turns
    assert all(f"reason={PIN_REASON};" in decision for _, _, decision in turns[1:]), turns
    prompts = [resp.usage.input_tokens for resp, _, _ in turns]
    assert prompts[0] < prompts[1] < prompts[2]
    assert all(1 <= resp.usage.output_tokens <= 4 for resp, _, _ in turns)
    got = api.responses.retrieve(previous)
    assert got.id == previous
    with pytest.raises(openai.NotFoundError):
        api.responses.create(model=rh.MODEL, input="x", previous_response_id="resp_unknown")


def test_responses_stream_is_measured_token_true(api: openai.OpenAI, proxy: rh.Running) -> None:
    """A streamed response: vLLM's event sequence reaches the client; the proxy's count of
    output tokens is vLLM's usage."""
    raw = api.responses.with_raw_response.create(
        model=rh.MODEL, input="hello world", max_output_tokens=16, stream=True
    )
    events = list(raw.parse())
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    done = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == done.output_text
    record = _record(proxy, raw.headers["x-request-id"])
    (attempt,) = record["attempts"]
    assert attempt["outcome"] == "success"
    assert attempt["output_tokens"] == done.usage.output_tokens


def test_messages_create_and_stream(claude: anthropic.Anthropic, proxy: rh.Running) -> None:
    """``messages.create`` and ``messages.stream`` through the proxy: the streamed text is
    the final message's, the proxy's count of output tokens is vLLM's usage; an unknown
    model is the proxy's 404 as Anthropic's ``not_found_error``."""
    message = claude.messages.create(
        model=rh.MODEL,
        max_tokens=6,
        system="Be brief.",
        messages=[{"role": "user", "content": "hi"}],
    )
    assert message.type == "message" and message.role == "assistant"
    assert 1 <= message.usage.output_tokens <= 6 and message.usage.input_tokens > 0
    with claude.messages.stream(
        model=rh.MODEL, max_tokens=12, messages=[{"role": "user", "content": "hello world"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
        rid = stream.response.headers["x-request-id"]
    assert text == "".join(b.text for b in final.content if b.type == "text")
    record = _record(proxy, rid)
    (attempt,) = record["attempts"]
    assert attempt["outcome"] == "success"
    assert attempt["output_tokens"] == final.usage.output_tokens
    with pytest.raises(anthropic.NotFoundError) as err:
        claude.messages.create(
            model="nope", max_tokens=2, messages=[{"role": "user", "content": "x"}]
        )
    assert err.value.body["error"]["type"] == "not_found_error"


def test_engine_rejections_are_each_clients_typed_error(
    api: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    """vLLM's own 400 (a negative temperature, which its sampling parameters reject) reaches
    each official client as its ``BadRequestError``, on Messages in Anthropic's shape."""
    with pytest.raises(openai.BadRequestError):
        api.responses.create(model=rh.MODEL, input="x", max_output_tokens=2, temperature=-1.0)
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(
            model=rh.MODEL,
            max_tokens=2,
            messages=[{"role": "user", "content": "x"}],
            extra_body={"temperature": -1.0},  # anthropic 2.x has no temperature argument
        )
    assert err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "invalid_request_error"
