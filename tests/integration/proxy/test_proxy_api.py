"""The OpenAI surface of the proxy, through the official ``openai`` client and raw HTTP."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest
from proxy_harness import Harness

pytestmark = pytest.mark.integration


def _assert_openai_error(body: dict, code: str | None = None) -> None:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code


def test_proxy_malformed_json_is_400(h) -> None:
    """A body that is not JSON gets an OpenAI-shaped 400 with a request id."""

    async def main() -> None:
        async with h.proxy_stack(1) as st, aiohttp.ClientSession() as s:
            async with s.post(
                st.url + "/v1/chat/completions",
                data=b'{"model": "demo-8b", "messages": [',
                headers={"Content-Type": "application/json"},
            ) as resp:
                assert resp.status == 400
                assert resp.headers["x-request-id"].startswith("req-")
                body = await resp.json()
        _assert_openai_error(body)
        assert body["error"]["type"] == "invalid_request_error"

    h.run(main())


def test_proxy_missing_and_unknown_model_through_openai(h: Harness) -> None:
    """Missing model → BadRequestError (param model); unknown model → NotFoundError."""

    async def main() -> None:
        async with h.proxy_stack(1) as st:
            client = st.client()
            msgs = [{"role": "user", "content": "hi"}]
            with pytest.raises(openai.BadRequestError) as bad:
                await asyncio.to_thread(
                    client.chat.completions.create, model="", messages=msgs, max_tokens=2
                )
            assert bad.value.status_code == 400 and bad.value.param == "model"
            with pytest.raises(openai.NotFoundError) as nf:
                await asyncio.to_thread(
                    client.chat.completions.create, model="no-such", messages=msgs, max_tokens=2
                )
            assert nf.value.code == "model_not_found"
            with pytest.raises(openai.NotFoundError):
                await asyncio.to_thread(client.get, "/no/such/route", cast_to=object)

    h.run(main())


def test_proxy_body_over_limit_is_413(h) -> None:
    """A body larger than limits.max_body_bytes gets an OpenAI-shaped 413."""

    async def main() -> None:
        async with h.proxy_stack(1, extra="[limits]\nmax_body_bytes = 2048\n") as st:
            client = st.client()
            with pytest.raises(openai.APIStatusError) as exc:
                await asyncio.to_thread(
                    client.chat.completions.create,
                    model=h.MODEL,
                    messages=[{"role": "user", "content": "x" * 4096}],
                    max_tokens=2,
                )
            assert exc.value.status_code == 413
            assert exc.value.code == "request_too_large"

    h.run(main())


def test_proxy_chat_and_completions_through_openai(h: Harness) -> None:
    """Chat and completions, JSON and streamed, work through the official client."""

    async def main() -> None:
        async with h.proxy_stack(2) as st:
            client = st.client()
            msgs = [{"role": "user", "content": "hello"}]
            raw = await asyncio.to_thread(
                client.chat.completions.with_raw_response.create,
                model=h.MODEL,
                messages=msgs,
                max_tokens=5,
                extra_body={"ignore_eos": True},
            )
            assert raw.headers["x-fastroute-engine"] in {"engine-0", "engine-1"}
            assert "policy=prefix-hrw" in raw.headers["x-fastroute-decision"]
            chat = raw.parse()
            assert chat.choices[0].message.content and chat.usage.completion_tokens == 5

            def stream_chat() -> list[str]:
                stream = client.chat.completions.create(
                    model=h.MODEL,
                    messages=msgs,
                    max_tokens=6,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                return [c.choices[0].delta.content or "" for c in stream if c.choices]

            pieces = await asyncio.to_thread(stream_chat)
            assert len([p for p in pieces if p]) == 6

            comp = await asyncio.to_thread(
                client.completions.create,
                model=h.MODEL,
                prompt="Once upon",
                max_tokens=3,
                extra_body={"ignore_eos": True},
            )
            assert comp.choices[0].text and comp.usage.completion_tokens == 3

            def stream_comp() -> list[str]:
                stream = client.completions.create(
                    model=h.MODEL,
                    prompt="Once upon",
                    max_tokens=4,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                return [c.choices[0].text for c in stream if c.choices]

            assert len([t for t in await asyncio.to_thread(stream_comp) if t]) == 4

    h.run(main())


def test_proxy_models_health_ready(h: Harness) -> None:
    """/v1/models lists the fleet's models; /health and /ready answer 200 while serving."""

    async def main() -> None:
        async with h.proxy_stack(1) as st:
            models = await asyncio.to_thread(st.client().models.list)
            assert [m.id for m in models.data] == [h.MODEL]
            async with aiohttp.ClientSession() as s:
                async with s.get(st.url + "/health") as resp:
                    assert resp.status == 200
                async with s.get(st.url + "/ready") as resp:
                    assert resp.status == 200
                    assert (await resp.json())["weights"] == "config"
                async with s.post(st.url + "/v1/models") as resp:
                    assert resp.status == 405
                    _assert_openai_error(await resp.json(), "method_not_allowed")

    h.run(main())


def test_proxy_metrics_after_requests(h: Harness) -> None:
    """/metrics exposes request counts by class/engine/status and latency histograms."""

    async def main() -> None:
        async with h.proxy_stack(1) as st, aiohttp.ClientSession() as s:
            body = h.chat_body("count me", stream=True)
            async with s.post(st.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                await h.read_sse(resp)
            async with s.get(st.url + "/metrics") as resp:
                assert resp.status == 200
                text = await resp.text()
        assert (
            'fastroute_proxy_requests_total{class="demo-8b/default",engine="engine-0",'
            'status="200"} 1.0' in text
        )
        assert 'fastroute_proxy_ttft_seconds_count{class="demo-8b/default"' in text
        assert "fastroute_proxy_table_generation 0.0" in text

    h.run(main())


def test_proxy_tenants_and_priority(h: Harness) -> None:
    """Tenant by API key (401 without one), priority header picks the class, bad one is 400."""
    extra = '[[tenants]]\nname = "acme"\napi_keys = ["sk-acme"]\ndefault_priority = "batch"\n'

    async def main() -> None:
        async with h.proxy_stack(1, extra=extra) as st, aiohttp.ClientSession() as s:
            url = st.url + "/v1/chat/completions"
            async with s.post(url, json=h.chat_body("hi")) as resp:
                assert resp.status == 401
                _assert_openai_error(await resp.json(), "invalid_api_key")
            auth = {"Authorization": "Bearer sk-acme"}
            async with s.post(url, json=h.chat_body("hi"), headers=auth) as resp:
                assert resp.status == 200
                assert "class=demo-8b/batch" in resp.headers["x-fastroute-decision"]
                rid = resp.headers["x-request-id"]
            record = st.ctx.decisions.get(rid)
            assert record is not None and record.tenant == "acme"
            hdrs = {**auth, "x-fastroute-priority": "interactive"}
            async with s.post(url, json=h.chat_body("hi"), headers=hdrs) as resp:
                assert resp.status == 200
                assert "class=demo-8b/interactive" in resp.headers["x-fastroute-decision"]
            hdrs = {**auth, "x-fastroute-priority": "urgent"}
            async with s.post(url, json=h.chat_body("hi"), headers=hdrs) as resp:
                assert resp.status == 400
                _assert_openai_error(await resp.json(), "invalid_priority")

    h.run(main())


def test_proxy_embeddings_are_routed_and_relayed(h: Harness) -> None:
    """/v1/embeddings is routed like the others; the engine's answer (here 404) is relayed."""

    async def main() -> None:
        async with h.proxy_stack(1) as st, aiohttp.ClientSession() as s:
            body = {"model": h.MODEL, "input": "embed me"}
            async with s.post(st.url + "/v1/embeddings", json=body) as resp:
                assert resp.status == 404
                assert resp.headers["x-fastroute-engine"] == "engine-0"
                payload = await resp.json()
            _assert_openai_error(payload)
            assert "127.0.0.1" not in payload["error"]["message"]

    h.run(main())


def test_requests_rejected_before_routing_have_decision_records(h: Harness) -> None:
    """400 (bad JSON), 404 (unknown model) and 413 (too large) keep a decision record
    that says why, found by the response's request id."""

    async def main() -> None:
        extra = "[limits]\nmax_body_bytes = 2048\n"
        async with h.proxy_stack(1, extra=extra) as st, aiohttp.ClientSession() as s:
            cases = [
                (b'{"model": ', 400, "Invalid request body"),
                (b'{"model": "no-such", "messages": []}', 404, "no-such"),
                (b"{" + b" " * 4096 + b"}", 413, "larger than the limit"),
            ]
            for body, status, why in cases:
                url = st.url + "/v1/chat/completions"
                async with s.post(url, data=body) as resp:
                    assert resp.status == status
                    rid = resp.headers["x-request-id"]
                async with s.get(st.url + f"/admin/decisions/{rid}") as resp:
                    assert resp.status == 200
                    record = await resp.json()
                assert record["status"] == status and record["attempts"] == []
                assert record["error"].startswith(f"rejected before routing (HTTP {status})")
                assert why in record["error"]
            assert record["model"] == ""  # 413: never parsed

    h.run(main())
