"""The engine endpoints besides chat/completions/embeddings, through the real proxy against
emulated engines (and a plain aiohttp engine for pass-through and the model-list fallback)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import uuid
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest
import yarl
from aiohttp import web
from proxy_harness import Harness, decision_record, pd_stack, serve_proxy

from fastroute.config import decode_config
from fastroute.emulator.server import EmulatedFleet, fleet_specs
from fastroute.proxy.path.endpoints import ENDPOINTS
from fastroute.testing.servers import serve_app

pytestmark = pytest.mark.integration

#: A JSON body each routed JSON endpoint accepts (vLLM 0.32's fields).
JSON_BODIES = {
    "/tokenize": {"prompt": "hello proxy"},
    "/detokenize": {"tokens": [1819043176, 1886330991]},
    "/pooling": {"input": ["a b", "c"]},
    "/classify": {"input": "a b"},
    "/score": {"text_1": "a b", "text_2": ["a b", "c d"]},
    "/v1/score": {"queries": "a b", "documents": ["a", "b"]},
    "/rerank": {"query": "a b", "documents": ["c", "a b"], "top_n": 1},
    "/v1/rerank": {"query": "a b", "documents": ["c", "a b"]},
    "/v2/rerank": {"query": "a b", "documents": ["c", "a b"]},
}
#: What each JSON endpoint's answer must carry (its vLLM shape).
JSON_KEYS = {
    "/tokenize": {"count", "max_model_len", "tokens", "token_strs"},
    "/detokenize": {"prompt"},
    "/pooling": {"id", "object", "created", "model", "data", "usage"},
    "/classify": {"id", "object", "created", "model", "data", "usage"},
    "/score": {"id", "object", "created", "model", "data", "usage"},
    "/v1/score": {"id", "object", "created", "model", "data", "usage"},
    "/rerank": {"id", "model", "usage", "results"},
    "/v1/rerank": {"id", "model", "usage", "results"},
    "/v2/rerank": {"id", "model", "usage", "results"},
}


def _form(model: str | None, audio: bytes, **fields: str) -> aiohttp.FormData:
    form = aiohttp.FormData()
    if model is not None:
        form.add_field("model", model)
    for name, value in fields.items():
        form.add_field(name, value)
    form.add_field("file", audio, filename="clip.wav", content_type="audio/wav")
    return form


def test_every_json_endpoint_is_routed_least_loaded_with_a_record(h: Harness) -> None:
    """Each JSON endpoint answers the engine's body through the proxy, decided by
    least-request and recorded like chat."""
    assert set(JSON_BODIES) == {p for p, e in ENDPOINTS.items() if e.kind != "audio"}

    async def main() -> None:
        async with h.proxy_stack(2) as st, aiohttp.ClientSession() as s:
            for path, body in JSON_BODIES.items():
                async with s.post(st.url + path, json={"model": h.MODEL, **body}) as resp:
                    assert resp.status == 200, (path, await resp.text())
                    engine = resp.headers["x-fastroute-engine"]
                    rid = resp.headers["x-request-id"]
                    answer = await resp.json()
                assert JSON_KEYS[path] <= set(answer), (path, answer)
                record = await decision_record(s, st.url, rid)
                assert record["endpoint"] == path and record["model"] == h.MODEL
                assert record["policy"] == "least-request"
                assert record["status"] == 200
                assert [a["engine"] for a in record["attempts"]] == [engine]

    h.run(main())


def test_tokenize_detokenize_round_trip_matches_prompt_tokens(h: Harness) -> None:
    """/tokenize's count is the prompt_tokens a completion of the same prompt reports, and
    /detokenize gives the prompt back."""

    async def main() -> None:
        prompt = "The proxy routes tokenizer calls to the least-loaded engine."
        async with h.proxy_stack(2) as st, aiohttp.ClientSession() as s:
            async with s.post(st.url + "/tokenize", json={"model": h.MODEL, "prompt": prompt}) as r:
                assert r.status == 200
                tok = await r.json()
            async with s.post(
                st.url + "/detokenize", json={"model": h.MODEL, "tokens": tok["tokens"]}
            ) as r:
                assert r.status == 200
                assert (await r.json())["prompt"] == prompt
            client = st.client()
            done = await asyncio.to_thread(
                client.completions.create, model=h.MODEL, prompt=prompt, max_tokens=1
            )
        assert tok["count"] == len(tok["tokens"]) == done.usage.prompt_tokens
        assert tok["max_model_len"] > 0

    h.run(main())


def test_endpoints_go_to_the_engine_with_fewest_in_flight(h: Harness) -> None:
    """With long streams in flight on one engine, tokenizer and pooling calls go to the other."""

    async def main() -> None:
        async with h.proxy_stack(2) as st, aiohttp.ClientSession() as s:
            body = h.chat_body("keep going", max_tokens=4000, ignore_eos=True, stream=True)
            streams = [
                await s.post(
                    st.url + "/v1/chat/completions", json=body, headers={"x-session-id": "pin"}
                )
                for _ in range(3)
            ]
            try:
                busy = {r.headers["x-fastroute-engine"] for r in streams}
                assert len(busy) == 1  # one session key: one engine
                in_flight = st.ctx.fleet.stats.in_flight
                await h.wait_until(lambda: max(in_flight()) >= 3, timeout=5.0)
                for path in ("/tokenize", "/pooling", "/rerank"):
                    async with s.post(
                        st.url + path, json={"model": h.MODEL, **JSON_BODIES[path]}
                    ) as resp:
                        assert resp.status == 200
                        assert resp.headers["x-fastroute-engine"] not in busy
            finally:
                for r in streams:
                    r.close()

    h.run(main())


def test_unknown_and_missing_model_and_methods(h: Harness) -> None:
    """Unknown model 404, no model 400, GET on an endpoint 405, malformed JSON 400."""

    async def main() -> None:
        async with h.proxy_stack(1) as st, aiohttp.ClientSession() as s:
            async with s.post(
                st.url + "/score", json={"model": "nope", "text_1": "a", "text_2": "b"}
            ) as r:
                assert r.status == 404
                assert (await r.json())["error"]["code"] == "model_not_found"
            async with s.post(st.url + "/tokenize", json={"prompt": "x"}) as r:
                assert r.status == 400
                err = (await r.json())["error"]
                assert err["code"] == "missing_model" and err["param"] == "model"
            async with s.get(st.url + "/tokenize") as r:
                assert r.status == 405
            async with s.post(
                st.url + "/rerank", data=b"{not json", headers={"Content-Type": "application/json"}
            ) as r:
                assert r.status == 400
            with pytest.raises(openai.NotFoundError):
                await asyncio.to_thread(
                    st.client().audio.transcriptions.create,
                    model="nope",
                    file=("clip.wav", io.BytesIO(b"\1" * 64)),
                )

    h.run(main())


def test_audio_through_the_openai_client(h: Harness) -> None:
    """Transcription with the official client (translation with aiohttp): multipart
    forwarded byte for byte, the engine's answer relayed."""

    async def main() -> None:
        async with h.proxy_stack(2) as st:
            client = st.client()
            audio = b"\1" * 70_000  # 3 s at the emulator's 32 kB/s
            text = await asyncio.to_thread(
                client.audio.transcriptions.create,
                model=h.MODEL,
                file=("clip.wav", io.BytesIO(audio)),
            )
            assert text.text == f"emulated transcription of 3 s of audio by {h.MODEL}"
            async with aiohttp.ClientSession() as s:  # the client's translations are deprecated
                form = _form(h.MODEL, audio)
                async with s.post(st.url + "/v1/audio/translations", data=form) as r:
                    assert r.status == 200
                    translated = await r.json()
            assert translated == {"text": f"emulated translation of 3 s of audio by {h.MODEL}"}
            plain = await asyncio.to_thread(
                client.audio.transcriptions.create,
                model=h.MODEL,
                file=("clip.wav", io.BytesIO(audio)),
                response_format="text",
            )
            assert plain.strip() == text.text

    h.run(main())


def test_audio_stream_is_relayed_and_its_limit_is_its_own(h: Harness) -> None:
    """A streamed transcription arrives as the engine's SSE events; an audio body over
    max_body_bytes but within max_audio_body_bytes is routed; over that: 413."""
    limits = "\n[limits]\nmax_body_bytes = 4096\nmax_audio_body_bytes = 65536\n"

    async def main() -> None:
        async with h.proxy_stack(1, extra=limits) as st, aiohttp.ClientSession() as s:
            async with s.post(
                st.url + "/v1/audio/transcriptions",
                data=_form(h.MODEL, b"\1" * 20_000, stream="true"),
            ) as r:
                assert r.status == 200
                assert r.headers["Content-Type"].startswith("text/event-stream")
                events, done = await h.read_sse(r)
            assert done and {e["object"] for e in events} == {"transcription.chunk"}
            text = "".join(e["choices"][0]["delta"]["content"] for e in events)
            assert text.strip() == f"emulated transcription of 1 s of audio by {h.MODEL}"
            async with s.post(
                st.url + "/v1/audio/transcriptions", data=_form(h.MODEL, b"\1" * 100_000)
            ) as r:
                assert r.status == 413
                err = (await r.json())["error"]
                assert err["code"] == "request_too_large"
                assert "limits.max_audio_body_bytes" in err["message"]
            async with s.post(
                st.url + "/tokenize", json={"model": h.MODEL, "prompt": "x" * 8000}
            ) as r:
                assert r.status == 413  # the JSON endpoints keep max_body_bytes
            async with s.post(st.url + "/v1/audio/translations", data=_form(None, b"\1" * 64)) as r:
                assert r.status == 400
                assert (await r.json())["error"]["code"] == "missing_model"
            async with s.post(
                st.url + "/v1/audio/translations",
                data=b"--b\r\nContent-Disposition: form-data; name=model\r\n",
                headers={"Content-Type": "multipart/form-data; boundary=b"},
            ) as r:
                assert r.status == 400

    h.run(main())


def _echo_engine() -> web.Application:
    """An OpenAI-compatible engine with a path of its own and no /v1/models."""

    async def echo(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"path": request.path, "model": body.get("model")})

    app = web.Application()
    app.router.add_post("/v1/custom/echo", echo)
    app.router.add_post("/v1/custom/other", echo)
    return app


@contextlib.asynccontextmanager
async def _echo_proxy(h: Harness, passthrough: list[str]) -> AsyncIterator[str]:
    async with serve_app(_echo_engine()) as engine_url:
        toml = (
            f'[[engines]]\nname = "echo-0"\nurl = "{engine_url}"\nmodels = ["{h.MODEL}"]\n'
            'kind = "openai"\n'
            f"\n[proxy]\nport = 0\ntable_name = {_absent_table()!r}\n"
            f"passthrough_paths = {passthrough!r}\n".replace("'", '"')
        )
        async with serve_proxy(decode_config(toml, source="echo.toml")) as (_, url, _server):
            yield url


def test_passthrough_allowed_and_denied(h: Harness) -> None:
    """A path under /v1/ reaches the engine only when proxy.passthrough_paths allows it."""

    async def main() -> None:
        body = {"model": h.MODEL}
        async with _echo_proxy(h, ["/v1/custom/echo"]) as url, aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/custom/echo", json=body) as r:
                assert r.status == 200
                assert await r.json() == {"path": "/v1/custom/echo", "model": h.MODEL}
                assert r.headers["x-fastroute-engine"] == "echo-0"
            async with s.post(url + "/v1/custom/other", json=body) as r:
                assert r.status == 404
                assert (await r.json())["error"]["code"] == "unknown_url"
            async with s.post(url + "/v1/custom/echo", json={"model": "nope"}) as r:
                assert r.status == 404
                assert (await r.json())["error"]["code"] == "model_not_found"
        async with _echo_proxy(h, ["/v1/custom/"]) as url, aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/custom/other", json=body) as r:
                assert r.status == 200 and (await r.json())["path"] == "/v1/custom/other"
            dotted = yarl.URL(url + "/v1/custom/x/../echo", encoded=True)  # not normalised
            async with s.post(dotted, json=body) as r:
                assert r.status == 404
        async with _echo_proxy(h, []) as url, aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/custom/echo", json=body) as r:
                assert r.status == 404

    h.run(main())


def test_models_fallback_for_an_engine_without_a_model_list(h: Harness) -> None:
    """An engine without /v1/models counts as serving its configured models."""

    async def main() -> None:
        async with _echo_proxy(h, []) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            models = await asyncio.to_thread(client.models.list)
            async with aiohttp.ClientSession() as s, s.get(url + "/ready") as r:
                ready = await r.json()
        assert [(m.id, m.owned_by) for m in models.data] == [(h.MODEL, "fastroute")]
        assert r.status == 200 and ready["unserved_models"] == []

    h.run(main())


def test_models_are_the_union_of_the_engines_lists_with_lora(h: Harness) -> None:
    """/v1/models lists what the engines report: the base model with max_model_len, and a
    LoRA adapter of one engine as its own id with the base as parent."""

    async def main() -> None:
        specs = fleet_specs(2, model_name=h.MODEL, profile="h100")
        specs[1] = dataclasses.replace(specs[1], lora_adapters=("demo-lora",))
        async with EmulatedFleet(specs) as fleet:
            toml = h_config(fleet.urls, h.MODEL)
            async with serve_proxy(decode_config(toml, source="lora.toml")) as (app, url, _):
                await h.wait_until(lambda: app.context.models.answered("engine-1"), timeout=5.0)
                client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
                models = await asyncio.to_thread(client.models.list)
        by_id = {m.id: m for m in models.data}
        assert set(by_id) == {h.MODEL, "demo-lora"}
        assert by_id[h.MODEL].owned_by == "vllm"
        assert by_id[h.MODEL].max_model_len == fleet.engines[0].model.max_model_len
        assert by_id["demo-lora"].parent == h.MODEL

    h.run(main())


def h_config(urls: list[str], *model_lists: str) -> str:
    """Engines at ``urls``, each serving the comma-separated models of ``model_lists``
    (one string for all)."""
    lists = list(model_lists) * len(urls) if len(model_lists) == 1 else list(model_lists)
    tables = "".join(
        f'[[engines]]\nname = "engine-{i}"\nurl = "{u}"\n'
        f"models = [{', '.join(repr(m) for m in models.split(','))}]\n".replace("'", '"')
        for i, (u, models) in enumerate(zip(urls, lists, strict=True))
    )
    return tables + (
        f'\n[proxy]\nport = 0\ntable_name = "{_absent_table()}"\nmodels_scrape_interval_s = 0.2\n'
    )


def _absent_table() -> str:
    """A weight-table name no writer uses (the proxy routes on the config's weights)."""
    return f"fastroute-test-absent-{uuid.uuid4().hex[:12]}"


def test_ready_names_a_model_no_engine_serves(h: Harness) -> None:
    """A configured model no engine reports is named in /ready (200 while another is
    served, 503 when none is)."""

    async def main() -> None:
        specs = fleet_specs(1, model_name=h.MODEL, profile="h100")
        async with EmulatedFleet(specs) as fleet, aiohttp.ClientSession() as s:
            toml = h_config(fleet.urls, f"{h.MODEL},ghost-model")
            async with serve_proxy(decode_config(toml, source="ghost.toml")) as (app, url, _):
                await h.wait_until(lambda: app.context.models.answered("engine-0"), timeout=5.0)
                async with s.get(url + "/ready") as r:
                    assert r.status == 200
                    assert (await r.json())["unserved_models"] == ["ghost-model"]
            toml = h_config(fleet.urls, "ghost-model")
            async with serve_proxy(decode_config(toml, source="ghost.toml")) as (app, url, _):
                await h.wait_until(lambda: app.context.models.answered("engine-0"), timeout=5.0)
                async with s.get(url + "/ready") as r:
                    assert r.status == 503
                    assert (await r.json())["unserved_models"] == ["ghost-model"]

    h.run(main())


def test_ping_version_load(h: Harness) -> None:
    """/ping is the proxy's liveness (GET and POST); /version and /load are not routed."""

    async def main() -> None:
        async with h.proxy_stack(1) as st, aiohttp.ClientSession() as s:
            for method in ("GET", "POST"):
                async with s.request(method, st.url + "/ping") as r:
                    assert r.status == 200 and (await r.json())["status"] == "ok"
            for path in ("/version", "/load"):
                async with s.get(st.url + path) as r:
                    assert r.status == 404
                    assert (await r.json())["error"]["code"] == "not_routed"

    h.run(main())


def test_a_pd_models_endpoint_requests_go_to_its_decode_pool(h: Harness) -> None:
    """A P/D model's tokenizer and rerank calls are whole requests on a decode engine."""

    async def main() -> None:
        async with pd_stack() as (_, _ctx, url), aiohttp.ClientSession() as s:
            for path in ("/tokenize", "/rerank"):
                body = {"model": h.MODEL, **JSON_BODIES[path]}
                async with s.post(url + path, json=body) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers["x-fastroute-engine"].startswith("decode-")
                    record = await decision_record(s, url, r.headers["x-request-id"])
                assert [a["stage"] for a in record["attempts"]] == [None]

    h.run(main())
