"""P/D through the proxy with SGLang's bootstrap protocol: emulated SGLang prefill and
decode engines (``kind = "sglang"``), the same request sent to both at once.

End to end through the official client (JSON and SSE), the decision record (both
engines, the room), concurrent dispatch observed on the engines (the decode engine
waits on the prefill engine's bootstrap server while the prefill still runs), the
prefill's ``cached_tokens`` in the client's usage, and a prefill that fails while its
decode waits: a clean 502, the decode cancelled (not counted against its engine).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from proxy_harness import MODEL, SHORT_OUTPUTS, TIMEOUTS, Harness, decision_record, serve_proxy

from fastroute.config import decode_config
from fastroute.emulator.server import EmulatedEngine, EmulatedFleet, EngineSpec
from fastroute.testing.waiting import wait_until

pytestmark = pytest.mark.integration

#: The decode engines' wait for a room: far longer than any test here, so a decode that
#: ends early was cancelled, not timed out.
DECODE_WAIT_S = 30.0
#: Bound of the waits for engine-side state in these tests.
WAIT_S = 10.0


def sglang_toml(engines: list[tuple[str, str, str, int | None]]) -> str:
    """A config of SGLang engines: (name, url, role, bootstrap port or None) each."""
    tables = []
    for name, url, role, port in engines:
        lines = [
            "[[engines]]",
            f'name = "{name}"',
            f'url = "{url}"',
            f'models = ["{MODEL}"]',
            f'role = "{role}"',
            'kind = "sglang"',
            'hardware = "h100"',
        ]
        if port is not None:
            lines.append(f"bootstrap_port = {port}")
        tables.append("\n".join(lines))
    timeouts = {**TIMEOUTS, "total_timeout_s": 20.0}
    return (
        "\n\n".join(tables)
        + "\n\n[retry]\nmin_retries_per_s = 50.0\n"
        + "\n[proxy]\nport = 0\n"
        + "\n[timeouts]\n"
        + "".join(f"{k} = {v}\n" for k, v in timeouts.items())
    )


def spec(name: str, role: str, **extra: Any) -> EngineSpec:
    return EngineSpec(
        name=name,
        model_name=MODEL,
        profile="h100",
        role=role,
        kind="sglang",
        output_lengths=SHORT_OUTPUTS,
        bootstrap_timeout_s=DECODE_WAIT_S,
        **extra,
    )


@contextlib.asynccontextmanager
async def sglang_stack(
    roles: tuple[str, ...] = ("prefill", "decode"),
) -> AsyncIterator[tuple[EmulatedFleet, Any, str]]:
    """SGLang engines of ``roles`` (named ``<role>-<i>``) behind the proxy:
    (fleet, context, url)."""
    specs = [spec(f"{role}-{i}", role) for i, role in enumerate(roles)]
    async with EmulatedFleet(specs) as fleet:
        engines = [(e.name, e.url, e.spec.role, e.bootstrap_port) for e in fleet.engines]
        toml = sglang_toml(engines)
        async with serve_proxy(decode_config(toml, source="sglang.toml")) as (app, url, _):
            yield fleet, app.context, url


def test_sglang_pd_end_to_end_through_the_openai_client(h: Harness) -> None:
    """JSON and SSE through the official client: the decode engine answers, the record
    names both engines and the room, and the client's cached_tokens is the prefill's."""

    async def main() -> None:
        async with sglang_stack() as (fleet, ctx, url), aiohttp.ClientSession() as s:
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=15.0)
            prompt = "a prompt long enough to fill a few KV blocks " * 8
            messages = [{"role": "user", "content": prompt}]
            raw = await asyncio.to_thread(
                client.chat.completions.with_raw_response.create,
                model=MODEL,
                messages=messages,
                max_tokens=5,
                extra_body={"ignore_eos": True},
            )
            out = raw.parse()
            assert out.choices[0].message.content
            assert out.usage.completion_tokens == 5
            assert raw.headers["x-fastroute-engine"] == "decode-1"
            record = await decision_record(s, url, raw.headers["x-request-id"])
            stages = sorted((a["stage"], a["engine"], a["outcome"]) for a in record["attempts"])
            assert stages == [
                ("decode", "decode-1", "success"),
                ("prefill", "prefill-0", "success"),
            ]
            assert 0 < record["timings"]["prefilled"] <= record["timings"]["done"]
            room = record["bootstrap_room"]
            assert isinstance(room, int) and 0 <= room < 2**63
            # A new prompt, twice: the prefill engine serves its blocks from cache the
            # second time, and the client's usage has the prefill engine's count.
            messages = [{"role": "user", "content": "another prompt for the cache " * 8}]
            cached = []
            for _ in range(2):
                chunks = await asyncio.to_thread(
                    lambda: list(
                        client.chat.completions.create(
                            model=MODEL,
                            messages=messages,
                            max_tokens=4,
                            stream=True,
                            stream_options={"include_usage": True},
                        )
                    )
                )
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                assert text
                usage = chunks[-1].usage
                assert usage is not None and usage.completion_tokens >= 1
                cached.append(usage.prompt_tokens_details.cached_tokens)
            assert cached[0] == 0 and 0 < cached[1] < usage.prompt_tokens
            assert fleet[1].model.num_running == 0 and fleet[0].model.num_held == 0
            assert ctx.pd is not None and ctx.pd.protocols[MODEL] == "bootstrap"

    h.run(main())


def test_sglang_pd_dispatches_both_requests_before_the_prefill_finishes(h: Harness) -> None:
    """With a slow prefill engine, the decode engine is seen waiting on the prefill
    engine's bootstrap server for the room while the prefill has not answered (the
    room is marked held when the prefill's step ends), and both of the proxy's attempts
    are open at once: the decode request went out without waiting for the prefill."""

    async def main() -> None:
        async with sglang_stack() as (fleet, ctx, url), aiohttp.ClientSession() as s:
            prefill: EmulatedEngine = fleet[0]
            await prefill.set_faults(slowdown=200.0)
            body = h.chat_body("slow prefill " * 40, max_tokens=3)
            request = asyncio.ensure_future(s.post(url + "/v1/chat/completions", json=body))
            await wait_until(lambda: prefill.rooms.waiting == 1, timeout=WAIT_S)
            assert not request.done()
            assert ctx.pd.prefill.in_flight[0] == 1 and ctx.pd.decode.in_flight[0] == 1
            async with await request as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["choices"][0]["message"]["content"]
            assert prefill.rooms.waiting == 0

    h.run(main())


def test_sglang_pd_fails_over_on_both_pools_with_a_fresh_room(h: Harness) -> None:
    """prefill-0 refuses connections and decode-2 answers 500: every request succeeds on
    prefill-1 and decode-3; a retried pair got a new room; the failing engines are
    charged, and neither failure marks an engine of the other pool."""

    async def main() -> None:
        roles = ("prefill", "prefill", "decode", "decode")
        async with sglang_stack(roles) as (fleet, ctx, url), aiohttp.ClientSession() as s:
            await fleet[0].set_faults(refuse_connections=True)
            await fleet[2].set_faults(error_rate=1.0, error_status=500)
            retried = 0
            for i in range(8):
                body = h.chat_body(f"question {i}")
                async with s.post(url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers["x-fastroute-engine"] == "decode-3"
                    record = await decision_record(s, url, r.headers["x-request-id"])
                last = {a["stage"]: a for a in record["attempts"]}
                assert last["prefill"]["engine"] == "prefill-1"
                assert last["prefill"]["outcome"] == last["decode"]["outcome"] == "success"
                failed = [
                    a for a in record["attempts"] if a["outcome"] not in ("success", "cancelled")
                ]
                assert {(a["engine"], a["outcome"]) for a in failed} <= {
                    ("prefill-0", "connect_error"),
                    ("decode-2", "http_5xx"),
                }
                retried += bool(failed)
            assert retried >= 1
            assert ctx.pd is not None
            now = ctx.pd.decode.clock()
            assert ctx.pd.prefill.outlier.available_mask(now).tolist()[1]
            assert ctx.pd.decode.outlier.available_mask(now).tolist()[1]
            assert all(e.model.num_running + e.model.num_waiting == 0 for e in fleet.engines)

    h.run(main())


class ScriptedPrefill:
    """A prefill engine that fails on cue: its completions wait for :attr:`fail`, then
    answer 500; its bootstrap endpoint holds the decode engine's wait open and notes
    when the decode engine gives up on it."""

    def __init__(self) -> None:
        self.fail = asyncio.Event()
        self.completions = 0
        self.bootstrap_waits = 0
        self.bootstrap_cancelled = 0
        self.app = web.Application()
        self.app.router.add_post("/v1/chat/completions", self._completions)
        self.app.router.add_post("/bootstrap/claim", self._claim)

    async def _completions(self, request: web.Request) -> web.Response:
        self.completions += 1
        body = await request.json()
        assert isinstance(body.get("bootstrap_room"), int)
        await self.fail.wait()
        return web.json_response({"object": "error", "message": "boom", "code": 500}, status=500)

    async def _claim(self, request: web.Request) -> web.Response:
        self.bootstrap_waits += 1
        try:
            await asyncio.sleep(DECODE_WAIT_S)
        except asyncio.CancelledError:
            self.bootstrap_cancelled += 1
            raise
        return web.json_response({"object": "error", "message": "late"}, status=404)


@contextlib.asynccontextmanager
async def serve_app(app: web.Application) -> AsyncIterator[int]:
    """Serve ``app`` on 127.0.0.1:0 (handlers cancelled when the client goes): its port."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


def test_sglang_pd_failing_prefill_is_a_clean_error_and_cancels_the_decode(h: Harness) -> None:
    """The prefill engine answers 500 while the decode engine waits for its KV: the
    client gets 502 in OpenAI shape at once (not after the decode's 30 s wait), the
    decode request is cancelled (its wait on the bootstrap server ends, it generated
    nothing), the prefill engine is charged with the failure, the decode engine not."""

    async def main() -> None:
        scripted = ScriptedPrefill()
        async with (
            serve_app(scripted.app) as port,
            EmulatedFleet([spec("decode-1", "decode")]) as fleet,
        ):
            decode = fleet[0]
            p_url = f"http://127.0.0.1:{port}"
            toml = sglang_toml(
                [("prefill-0", p_url, "prefill", port), ("decode-1", decode.url, "decode", None)]
            )
            async with serve_proxy(decode_config(toml, source="sglang.toml")) as (app, url, _):
                ctx = app.context
                async with aiohttp.ClientSession() as s:
                    body = h.chat_body("doomed", max_tokens=3)
                    request = asyncio.ensure_future(s.post(url + "/v1/chat/completions", json=body))
                    # both engines have the request before the prefill fails
                    await wait_until(
                        lambda: scripted.completions == 1 and scripted.bootstrap_waits == 1,
                        timeout=WAIT_S,
                    )
                    started = asyncio.get_running_loop().time()
                    scripted.fail.set()
                    async with await request as r:
                        assert r.status == 502
                        err = (await r.json())["error"]
                        assert err["code"] == "upstream_error"
                        rid = r.headers["x-request-id"]
                    assert asyncio.get_running_loop().time() - started < DECODE_WAIT_S / 3
                    # the decode engine stopped waiting for the room's KV: it was cancelled
                    await wait_until(lambda: scripted.bootstrap_cancelled == 1, timeout=WAIT_S)
                    record = await decision_record(s, url, rid)
                outcomes = {(a["stage"], a["outcome"]) for a in record["attempts"]}
                assert outcomes == {("prefill", "http_5xx"), ("decode", "cancelled")}
                assert decode.model.generation_tokens_total == 0
                assert decode.model.num_running + decode.model.num_waiting == 0
                assert ctx.pd is not None
                now = ctx.pd.decode.clock()
                assert ctx.pd.decode.outlier.available_mask(now).all()
                assert ctx.pd.decode.outlier.failure_streak(0) == 0
                assert ctx.pd.prefill.outlier.failure_streak(0) == 1
                assert ctx.pd.decode.in_flight[0] == 0 and ctx.pd.prefill.in_flight[0] == 0

    h.run(main())
