"""OpenAI/vLLM API of an emulated engine over real HTTP on loopback."""

from __future__ import annotations

import asyncio
import statistics
import time

import aiohttp
import openai
import pytest

from fastroute.emulator.model import EngineConfig, OutputLengthDistribution
from fastroute.emulator.server import DEFAULT_MODEL_NAME, EmulatedFleet, EngineSpec
from fastroute.tokens import count_text_tokens, render_chat, tokenize_text

pytestmark = pytest.mark.integration

MODEL = DEFAULT_MODEL_NAME
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]


def test_openai_client_chat_and_completions(arun):
    """The official openai client works for chat and completions, streaming and not."""

    async def main():
        async with EmulatedFleet([EngineSpec(profile="h100")]) as fleet:
            async with openai.AsyncOpenAI(
                base_url=fleet.urls[0] + "/v1", api_key="x", max_retries=0
            ) as client:
                models = await client.models.list()
                assert [m.id for m in models.data] == [MODEL]

                chat = await client.chat.completions.create(
                    model=MODEL, messages=MSGS, max_tokens=7
                )
                assert (
                    chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
                )
                assert chat.usage.completion_tokens == len(chat.choices[0].message.content.split())
                assert chat.usage.completion_tokens <= 7
                assert chat.usage.prompt_tokens == tokenize_text(render_chat(MSGS)).num_tokens
                assert chat.choices[0].finish_reason in ("stop", "length")

                stream = await client.chat.completions.create(
                    model=MODEL, messages=MSGS, max_tokens=6, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                )  # fmt: skip
                chunks = [c async for c in stream]
                assert chunks[0].choices[0].delta.role == "assistant"
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                assert len(text.split()) == 6
                assert chunks[-2].choices[0].finish_reason == "length"
                assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6

                prompt = "Once upon a time, " * 10
                comp = await client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=5, extra_body={"ignore_eos": True}
                )
                assert comp.object == "text_completion" and comp.usage.completion_tokens == 5
                assert comp.usage.prompt_tokens == count_text_tokens(prompt)
                assert comp.choices[0].finish_reason == "length"

                cstream = await client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=4, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                )  # fmt: skip
                cchunks = [c async for c in cstream]
                assert "".join(c.choices[0].text for c in cchunks if c.choices).count(" ") == 4
                assert cchunks[-1].usage.total_tokens == count_text_tokens(prompt) + 4

    arun(main())


def test_bad_requests_get_openai_shaped_errors(arun):
    """Malformed JSON, missing messages, bad max_tokens, n>1, unknown model: 400/404 vLLM shape."""

    async def main():
        async with EmulatedFleet([EngineSpec(profile="h100")]) as fleet:
            url = fleet.urls[0]
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c:
                with pytest.raises(openai.NotFoundError) as nf:
                    await c.chat.completions.create(model="gpt-nope", messages=MSGS)
                assert nf.value.status_code == 404
                assert nf.value.body["type"] == "NotFoundError"
                assert "does not exist" in nf.value.body["message"]
                with pytest.raises(openai.BadRequestError) as br:
                    await c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=-1)
                assert br.value.body["param"] == "max_tokens"

            async with aiohttp.ClientSession() as s:
                cases = [
                    (b"{not json", 400, None),
                    (b'{"model": "%s"}' % MODEL.encode(), 400, "messages"),
                    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -3}', 400,
                     "max_tokens"),
                    (b'{"messages": [{"role": "user", "content": "x"}], "n": 2}', 400, "n"),
                    (b'{"model": "other", "messages": [{"role": "user", "content": "x"}]}', 404,
                     "model"),
                    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 9000}', 400,
                     None),
                ]  # fmt: skip
                for body, status, param in cases:
                    async with s.post(url + "/v1/chat/completions", data=body) as resp:
                        assert resp.status == status, body
                        err = (await resp.json())["error"]
                        assert set(err) == {"message", "type", "param", "code"}
                        assert err["code"] == status and err["param"] == param, body
                        assert err["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]
                async with s.post(url + "/v1/completions", json={"model": MODEL}) as resp:
                    assert resp.status == 400 and (await resp.json())["error"]["param"] == "prompt"

    arun(main())


def test_body_over_limit_is_413(arun):
    """A body larger than max_body_bytes gets 413 in the error shape; one under it is served."""

    async def main():
        async with EmulatedFleet([EngineSpec(profile="h100", max_body_bytes=2000)]) as fleet:
            async with aiohttp.ClientSession() as s:
                url = fleet.urls[0] + "/v1/completions"
                big = {"prompt": "x" * 3000, "max_tokens": 1}
                async with s.post(url, json=big) as resp:
                    assert resp.status == 413
                    assert (await resp.json())["error"]["code"] == 413
                async with s.post(url, json={"prompt": "x" * 1500, "max_tokens": 1}) as resp:
                    assert resp.status == 200

    arun(main())


def test_models_health_and_lengths(arun):
    """/v1/models and /health answer; ignore_eos, min_tokens and max_tokens fix lengths."""

    async def main():
        short = OutputLengthDistribution(mu=3.0, sigma=1.0)  # median 20 tokens
        spec = EngineSpec(profile="h100", seed=3, output_lengths=short)
        async with EmulatedFleet([spec]) as fleet:
            url = fleet.urls[0]
            async with aiohttp.ClientSession() as s:
                async with s.get(url + "/health") as resp:
                    assert resp.status == 200
                async with s.get(url + "/v1/models") as resp:
                    card = (await resp.json())["data"][0]
                    assert card["id"] == MODEL and card["max_model_len"] == 8192

                async def complete(**fields):
                    body = {"prompt": "count to ten", **fields}
                    async with s.post(url + "/v1/completions", json=body) as resp:
                        assert resp.status == 200
                        data = await resp.json()
                    return data["usage"]["completion_tokens"], data["choices"][0]["finish_reason"]

                assert await complete(max_tokens=12, ignore_eos=True) == (12, "length")
                assert await complete(max_tokens=9, min_tokens=9) == (9, "length")
                drawn = await asyncio.gather(*(complete(max_tokens=60) for _ in range(12)))
                assert all(1 <= n <= 60 for n, _ in drawn)
                assert all(r == ("length" if n == 60 else "stop") for n, r in drawn)
                assert len({n for n, _ in drawn}) > 3  # lengths are drawn, not fixed
                ids = list(range(100, 164))
                async with s.post(
                    url + "/v1/completions", json={"prompt": ids, "max_tokens": 1}
                ) as resp:
                    assert (await resp.json())["usage"]["prompt_tokens"] == 64

    arun(main())


def test_repeated_long_prefix_is_served_from_cache(arun, read_sse):
    """A second request sharing a long prefix reports cached_tokens and a lower TTFT."""
    system = "You are a meticulous assistant who answers in detail. " * 120  # ~6.5 kB

    async def ttft(s, url, question):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        body = {
            "messages": messages,
            "max_tokens": 2, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        t0 = time.perf_counter()
        async with s.post(url + "/v1/chat/completions", json=body) as resp:
            events, times, done = await read_sse(resp)
        assert done
        return times[0] - t0, events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]

    async def main():
        async with EmulatedFleet([EngineSpec(profile="a100")]) as fleet:
            async with aiohttp.ClientSession() as s:
                t1, c1 = await ttft(s, fleet.urls[0], "First question?")
                results = [await ttft(s, fleet.urls[0], f"Question {i}?") for i in range(3)]
        assert c1 == 0
        assert all(c > 1500 for _, c in results)
        assert statistics.median(t for t, _ in results) < 0.6 * t1

    arun(main())


def test_client_disconnect_cancels_the_request(arun, wait_until, scrape):
    """Closing a stream mid-way removes the request from the batch and counts an abort."""

    async def main():
        async with EmulatedFleet([EngineSpec(profile="h100")]) as fleet:
            engine = fleet[0]
            async with aiohttp.ClientSession() as s:
                body = {"prompt": "tell me a long story", "max_tokens": 2000, "ignore_eos": True,
                        "stream": True}  # fmt: skip
                resp = await s.post(engine.url + "/v1/completions", json=body)
                await resp.content.readline()  # first token arrived: it is running
                assert engine.model.num_running == 1
                resp.close()
                await wait_until(lambda: engine.model.num_running == 0, timeout=5)
                metrics = await scrape(s, engine.url)
                assert metrics["vllm:request_success_total{finished_reason=abort}"] == 1
                assert metrics["vllm:generation_tokens_total"] < 2000
                assert engine.model.kv.num_used == 0

    arun(main())


def test_full_waiting_queue_answers_429(arun):
    """With one seat and two waiting places, a burst of six gets at least three 429s."""

    async def main():
        cfg = EngineConfig(max_num_seqs=1, max_waiting=2)
        async with EmulatedFleet([EngineSpec(profile="h100", config=cfg)]) as fleet:
            async with aiohttp.ClientSession() as s:

                async def one():
                    body = {"prompt": "hi", "max_tokens": 10, "ignore_eos": True}
                    async with s.post(fleet.urls[0] + "/v1/completions", json=body) as resp:
                        return resp.status, resp.headers.get("Retry-After"), await resp.json()

                results = await asyncio.gather(*(one() for _ in range(6)))
        rejected = [r for r in results if r[0] == 429]
        assert len(rejected) >= 3
        assert all(r[1] == "1" and r[2]["error"]["type"] == "RateLimitError" for r in rejected)
        assert all(r[2]["usage"]["completion_tokens"] == 10 for r in results if r[0] == 200)

    arun(main())
