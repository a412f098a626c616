"""Failure handling: retries, ejection, mid-stream crashes, no engine, client disconnects."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from proxy_harness import Harness, Stack

from fastroute.hashing import key_hash

pytestmark = pytest.mark.integration

EJECT_FAST = "[ejection]\nconsecutive_failures = 2\nmax_ejected_fraction = 0.5\n"


def _sessions_first_on(st: Stack, engine: int, n: int) -> list[str]:
    """Session ids whose first choice (rendezvous, config weights) is ``engine``."""
    fleet = st.ctx.fleet
    row = fleet.rows[(st.config.models()[0], "default")]
    out: list[str] = []
    i = 0
    while len(out) < n:
        sid = f"sid-{i}"
        if fleet.state.selector.rank(key_hash(sid), row, 3)[0] == engine:
            out.append(sid)
        i += 1
    return out


async def _post(
    s: aiohttp.ClientSession, st: Stack, body: dict, sid: str
) -> aiohttp.ClientResponse:
    async with s.post(
        st.url + "/v1/chat/completions", json=body, headers={"x-session-id": sid}
    ) as resp:
        await resp.read()
        return resp


@pytest.mark.parametrize("fault", ["refuse", "http_500"])
def test_proxy_retries_on_next_engine_and_ejects(h: Harness, fault: str) -> None:
    """A refusing / 500-ing engine: its requests succeed on the runner-up, then it is ejected."""

    async def main() -> None:
        async with h.proxy_stack(3, extra=EJECT_FAST) as st, aiohttp.ClientSession() as s:
            if fault == "refuse":
                await st.fleet[0].set_faults(refuse_connections=True)
            else:
                await st.fleet[0].set_faults(error_rate=1.0, error_status=500)
            sids = _sessions_first_on(st, 0, 3)
            decisions = []
            for sid in sids:
                resp = await _post(s, st, h.chat_body("hi"), sid)
                assert resp.status == 200
                assert resp.headers["x-fastroute-engine"] != "engine-0"
                decisions.append(resp.headers["x-fastroute-decision"])
            # Two failures ejected engine-0: the third request went straight to the runner-up.
            assert "rank=1;attempt=2" in decisions[0] and "rank=1;attempt=2" in decisions[1]
            assert "rank=0;attempt=1" in decisions[2]
            assert st.ctx.fleet.outlier.is_ejected(0, st.ctx.fleet.clock())
            async with s.get(st.url + "/metrics") as resp:
                text = await resp.text()
            assert 'fastroute_proxy_ejections_total{engine="engine-0"} 1.0' in text
            assert "fastroute_proxy_retries_total 2.0" in text

    h.run(main())


def test_proxy_all_engines_failing_is_502(h: Harness) -> None:
    """Every engine answers 500: one retry, then an OpenAI-shaped 502 naming no address."""

    async def main() -> None:
        async with h.proxy_stack(2) as st:
            for engine in st.fleet.engines:
                await engine.set_faults(error_rate=1.0, error_status=500)
            with pytest.raises(openai.InternalServerError) as exc:
                await asyncio.to_thread(
                    st.client().chat.completions.create,
                    model=h.MODEL,
                    messages=[{"role": "user", "content": "x"}],
                    max_tokens=2,
                )
            assert exc.value.status_code == 502
            assert "127.0.0.1" not in str(exc.value.body)
            decision = exc.value.response.headers["x-fastroute-decision"]
            assert "attempt=2" in decision

    h.run(main())


def test_proxy_upstream_4xx_passed_through(h: Harness) -> None:
    """An engine's own 400 (prompt too long) reaches the client in OpenAI shape, not retried."""

    async def main() -> None:
        async with h.proxy_stack(2) as st:
            with pytest.raises(openai.BadRequestError) as exc:
                await asyncio.to_thread(
                    st.client().chat.completions.create,
                    model=h.MODEL,
                    messages=[{"role": "user", "content": "x"}],
                    max_tokens=10_000_000,
                )
            assert "attempt=1" in exc.value.response.headers["x-fastroute-decision"]
            assert "127.0.0.1" not in exc.value.message

    h.run(main())


def test_proxy_mid_stream_crash_sends_sse_error(h: Harness) -> None:
    """An engine dying mid-stream: the client gets the chunks, one SSE error event, a clean end."""

    async def main() -> None:
        async with h.proxy_stack(2) as st:
            for engine in st.fleet.engines:
                await engine.set_faults(crash_after_tokens=3)
            body = h.chat_body("tell me a story", stream=True, max_tokens=20, ignore_eos=True)
            async with aiohttp.ClientSession() as s:
                async with s.post(st.url + "/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200
                    events, done = await h.read_sse(resp)
            assert not done
            assert events and "error" in events[-1]
            assert events[-1]["error"]["code"] == "upstream_error"
            assert all("choices" in e for e in events[:-1]) and len(events) >= 2

            def via_openai() -> None:
                stream = st.client().chat.completions.create(
                    model=h.MODEL,
                    messages=body["messages"],
                    max_tokens=20,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                for _ in stream:
                    pass

            with pytest.raises(openai.APIError):
                await asyncio.to_thread(via_openai)

    h.run(main())


def test_proxy_no_engine_in_zone_is_503(h: Harness) -> None:
    """Narrowing residency to a zone without engines leaves no engine: OpenAI-shaped 503."""
    extra = (
        '[[network.regions]]\nname = "local"\nzone = "us"\n'
        '[[network.regions]]\nname = "eu-west"\nzone = "eu"\n'
        "[network.rtt_ms]\nlocal = { eu-west = 80.0 }\n"
    )

    async def main() -> None:
        async with h.proxy_stack(2, extra=extra) as st:
            with pytest.raises(openai.InternalServerError) as exc:
                await asyncio.to_thread(
                    st.client().chat.completions.create,
                    model=h.MODEL,
                    messages=[{"role": "user", "content": "x"}],
                    max_tokens=2,
                    extra_headers={"x-fastroute-zone": "eu"},
                )
            assert exc.value.status_code == 503 and exc.value.code == "no_engine_available"
            rid = exc.value.response.headers["x-request-id"]
            record = st.ctx.decisions.get(rid)
            assert record is not None
            assert {f["filter"] for f in record.filters} == {"residency"}

    h.run(main())


def test_proxy_client_disconnect_cancels_upstream(h: Harness) -> None:
    """A client leaving mid-stream cancels the upstream request and frees its slot."""

    async def main() -> None:
        async with h.proxy_stack(1) as st:
            await st.fleet[0].set_faults(slowdown=20.0)
            body = h.chat_body("long", stream=True, max_tokens=2000, ignore_eos=True)
            async with aiohttp.ClientSession() as s:
                resp = await s.post(st.url + "/v1/chat/completions", json=body)
                assert resp.status == 200
                line = await asyncio.wait_for(resp.content.readline(), 5.0)
                assert line.startswith(b"data: ")
                assert st.ctx.fleet.in_flight[0] == 1
                resp.close()
            await h.wait_until(lambda: st.ctx.fleet.in_flight[0] == 0, timeout=5.0)
            engine = st.fleet[0]
            await h.wait_until(lambda: not engine._channels, timeout=5.0)
            rid_records = [r for r in st.ctx.decisions._records.values() if r.status == 499]
            assert len(rid_records) == 1
            assert json.loads(rid_records[0].to_json())["attempts"][0]["engine"] == "engine-0"

    h.run(main())


def test_proxy_upstream_timeout_is_504(h: Harness) -> None:
    """Engines that never answer: first-byte timeout, one retry, then an OpenAI-shaped 504."""

    async def main() -> None:
        async with h.proxy_stack(2, timeouts={"first_byte_timeout_s": 0.3}) as st:
            for engine in st.fleet.engines:
                await engine.set_faults(hang=True)
            with pytest.raises(openai.InternalServerError) as exc:
                await asyncio.to_thread(
                    st.client().chat.completions.create,
                    model=h.MODEL,
                    messages=[{"role": "user", "content": "x"}],
                    max_tokens=2,
                )
            assert exc.value.status_code == 504 and exc.value.code == "upstream_timeout"
            assert "attempt=2" in exc.value.response.headers["x-fastroute-decision"]

    h.run(main())
