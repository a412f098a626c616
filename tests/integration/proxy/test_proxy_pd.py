"""P/D through the proxy: vLLM's ``kv_transfer_params`` protocol against emulated
prefill and decode engines (the emulator moves the KV between them).

End to end (JSON and SSE, the official client), a failing decode engine (retried on
the other decode engine), failing prefill engines (retried; all failing → 502), and
separate health: failures of one pool never eject engines of the other.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from proxy_harness import MODEL, Harness, decision_record, pd_stack

pytestmark = pytest.mark.integration

PD_RETRY = "[retry]\nmin_retries_per_s = 50.0\n"


def test_pd_end_to_end_json_stream_and_openai_client(h: Harness) -> None:
    """Prefill on a prefill engine, decode on a decode engine, relayed to the client."""

    async def main() -> None:
        async with pd_stack(PD_RETRY) as (_, ctx, url), aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/chat/completions", json=h.chat_body("hello")) as r:
                assert r.status == 200, await r.text()
                body = await r.json()
                rid = r.headers["x-request-id"]
                assert r.headers["x-fastroute-engine"].startswith("decode-")
            assert body["choices"][0]["message"]["content"]
            assert "kv_transfer_params" not in body or body["kv_transfer_params"] is None
            record = await decision_record(s, url, rid)
            stages = [
                (a["stage"], a["engine"].split("-")[0], a["outcome"]) for a in record["attempts"]
            ]
            assert stages == [("prefill", "prefill", "success"), ("decode", "decode", "success")]
            assert record["reason"].startswith("pd:")
            assert {c["stage"] for c in record["candidates"]} == {"prefill", "decode"}

            body = h.chat_body("stream me", stream=True, max_tokens=6)
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                events, done = await h.read_sse(r)
            assert done and events

            client = openai_client(url)
            out = await asyncio.to_thread(
                client.completions.create, model=MODEL, prompt="Once upon", max_tokens=3
            )
            assert out.choices[0].text
        assert ctx.pd is not None

    h.run(main())


def openai_client(url: str):  # noqa: ANN201 - openai.OpenAI
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=15.0)


def test_pd_decode_failure_retries_on_the_other_decode_engine(h: Harness) -> None:
    """decode-2 answers 500: every request still succeeds (decode retried on decode-3),
    decode-2 gets ejected, and no prefill engine is marked unhealthy."""

    async def main() -> None:
        async with pd_stack(PD_RETRY) as (fleet, ctx, url), aiohttp.ClientSession() as s:
            await fleet[2].set_faults(error_rate=1.0, error_status=500)
            retried = 0
            for i in range(12):
                body = h.chat_body(f"question {i}")
                async with s.post(url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers["x-fastroute-engine"] == "decode-3"
                    record = await decision_record(s, url, r.headers["x-request-id"])
                decodes = [a for a in record["attempts"] if a["stage"] == "decode"]
                if len(decodes) == 2:
                    assert decodes[0]["engine"] == "decode-2"
                    assert decodes[0]["outcome"] == "http_5xx"
                    retried += 1
            assert retried >= 1
            assert ctx.pd is not None
            now = ctx.pd.decode.clock()
            assert not ctx.pd.decode.outlier.available_mask(now)[0]  # decode-2 ejected
            assert ctx.pd.prefill.outlier.available_mask(now).all()

    h.run(main())


def test_pd_prefill_failure_retried_then_502_and_decode_stays_healthy(h: Harness) -> None:
    """prefill-0 refuses connections: requests succeed through prefill-1. Both prefill
    engines failing: 502 in OpenAI shape, and the decode engines are never marked
    unhealthy (nor even tried)."""

    async def main() -> None:
        async with pd_stack(PD_RETRY) as (fleet, ctx, url), aiohttp.ClientSession() as s:
            await fleet[0].set_faults(refuse_connections=True)
            for i in range(6):
                body = h.chat_body(f"q {i}")
                async with s.post(url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    record = await decision_record(s, url, r.headers["x-request-id"])
                prefills = [a for a in record["attempts"] if a["stage"] == "prefill"]
                assert prefills[-1]["engine"] == "prefill-1"
            await fleet[1].set_faults(error_rate=1.0, error_status=500)

            def decode_work() -> list[tuple[int, int]]:
                return [
                    (e.model.generation_tokens_total, sum(e.model.finished_total.values()))
                    for e in fleet.engines[2:]
                ]

            before = decode_work()
            async with s.post(url + "/v1/chat/completions", json=h.chat_body("x")) as r:
                assert r.status == 502
                err = (await r.json())["error"]
                assert err["code"] == "upstream_error" and "127.0.0.1" not in err["message"]
            assert decode_work() == before
            assert ctx.pd is not None
            assert ctx.pd.decode.outlier.available_mask(ctx.pd.decode.clock()).all()

    h.run(main())


def test_pd_with_min_tokens_succeeds_and_the_prefill_engine_gets_no_min_tokens(
    h: Harness,
) -> None:
    """``min_tokens: 4`` with ``max_tokens: 6``: the emulator, like vLLM, refuses
    ``min_tokens > max_tokens``, so a prefill body keeping it would fail with 400."""

    async def main() -> None:
        async with pd_stack(PD_RETRY) as (fleet, _, url), aiohttp.ClientSession() as s:
            for stream in (False, True):
                body = h.chat_body("at least four", max_tokens=6, min_tokens=4, stream=stream)
                async with s.post(url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    if stream:
                        events, done = await h.read_sse(r)
                        assert done and not any("error" in e for e in events)
                    else:
                        usage = (await r.json())["usage"]
                        assert usage["completion_tokens"] >= 4  # the decode kept min_tokens
                    record = await decision_record(s, url, r.headers["x-request-id"])
                assert [a["outcome"] for a in record["attempts"]] == ["success", "success"]
            prefills = sum(sum(e.model.finished_total.values()) for e in fleet.engines[:2])
            assert prefills == 2

    h.run(main())


def test_pd_usage_reports_the_prefill_engines_cached_tokens(h: Harness) -> None:
    """The decode engine counts the transferred prompt as cached; the client sees the
    prefill engine's count (0 for a prompt no engine has seen), JSON and streamed."""

    async def main() -> None:
        async with pd_stack(PD_RETRY) as (_, _ctx, url), aiohttp.ClientSession() as s:
            for i, stream in enumerate((False, True)):
                prompt = f"{i} a prompt nobody sent before: " + "word " * 200
                body = h.chat_body(prompt, system=f"{i} is new.", max_tokens=3, stream=stream)
                if stream:
                    body["stream_options"] = {"include_usage": True}
                async with s.post(url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    if stream:
                        events, done = await h.read_sse(r)
                        assert done
                        usages = [e["usage"] for e in events if e.get("usage")]
                        assert len(usages) == 1
                        usage = usages[0]
                    else:
                        usage = (await r.json())["usage"]
                assert usage["prompt_tokens"] > 200
                assert usage["prompt_tokens_details"] == {"cached_tokens": 0}

    h.run(main())
