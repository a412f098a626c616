"""Stickiness and spread of the routing key, the weight table, and the decision record."""

from __future__ import annotations

import asyncio
import uuid

import aiohttp
import pytest
from proxy_harness import Harness

from fastroute.hashing import engine_id
from fastroute.proxy.path.fleet import class_key
from fastroute.tables import TableWriter

pytestmark = pytest.mark.integration


async def _engine_of(s: aiohttp.ClientSession, url: str, body: dict, **headers: str) -> str:
    async with s.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers["x-fastroute-engine"]


def test_proxy_session_id_is_sticky(h: Harness) -> None:
    """50 sequential requests with one x-session-id (different prompts) hit one engine.

    Sequential: 50 concurrent requests of one session are a hot key, which the
    bounded-load guard (policy.bounded_load) deliberately spills.
    """

    async def main() -> None:
        async with h.proxy_stack(3) as st, aiohttp.ClientSession() as s:
            sid = "session-" + uuid.uuid4().hex
            engines = [
                await _engine_of(s, st.url, h.chat_body(f"question {i}"), **{"x-session-id": sid})
                for i in range(50)
            ]
        assert len(set(engines)) == 1

    h.run(main())


def test_proxy_conversation_stays_on_one_engine(h: Harness) -> None:
    """Turns of one conversation (no session id) share its key and so its engine."""

    async def main() -> None:
        async with h.proxy_stack(3) as st, aiohttp.ClientSession() as s:
            for conv in range(5):
                messages = [
                    {"role": "system", "content": "You are terse."},
                    {"role": "user", "content": f"conversation {conv}: first question"},
                ]
                seen = set()
                for turn in range(4):
                    body = {"model": h.MODEL, "messages": messages, "max_tokens": 2}
                    seen.add(await _engine_of(s, st.url, body))
                    messages = [
                        *messages,
                        {"role": "assistant", "content": f"answer {turn}"},
                        {"role": "user", "content": f"follow-up {turn}"},
                    ]
                assert len(seen) == 1, seen

    h.run(main())


def test_proxy_shared_system_prompt_spreads(h: Harness) -> None:
    """Conversations sharing only a system prompt are spread over the engines."""

    async def main() -> None:
        async with h.proxy_stack(3) as st, aiohttp.ClientSession() as s:
            engines = await asyncio.gather(
                *(_engine_of(s, st.url, h.chat_body(f"distinct question {i}")) for i in range(30))
            )
        counts = {e: engines.count(e) for e in set(engines)}
        assert len(counts) == 3, counts
        assert min(counts.values()) >= 3, counts

    h.run(main())


def test_proxy_decision_header_and_admin_record(h: Harness) -> None:
    """Responses carry engine + decision headers; /admin/decisions/{id} has the full record."""

    async def main() -> None:
        async with h.proxy_stack(3) as st, aiohttp.ClientSession() as s:
            headers = {"x-session-id": "abc", "x-fastroute-engine": "spoofed"}
            async with s.post(
                st.url + "/v1/chat/completions", json=h.chat_body("why?"), headers=headers
            ) as resp:
                assert resp.status == 200
                await resp.read()
                engine = resp.headers["x-fastroute-engine"]
                decision = resp.headers["x-fastroute-decision"]
                rid = resp.headers["x-request-id"]
            assert engine in {"engine-0", "engine-1", "engine-2"}
            fields = dict(kv.split("=", 1) for kv in decision.split(";"))
            assert fields["policy"] == "prefix-hrw" and fields["rank"] == "0"
            assert fields["attempt"] == "1" and fields["gen"] == "0"
            assert fields["key"] == "header"
            async with s.get(f"{st.url}/admin/decisions/{rid}") as resp:
                assert resp.status == 200
                record = await resp.json()
            async with s.get(f"{st.url}/admin/decisions/req-unknown") as resp:
                assert resp.status == 404
        assert record["request_id"] == rid and record["status"] == 200
        assert record["class_name"] == "demo-8b/default"
        assert [c["engine"] for c in record["candidates"]][0] == engine
        assert len(record["candidates"]) == 3
        assert all(c["weight"] == 10.0 for c in record["candidates"])
        assert record["attempts"] == [
            {
                "engine": engine,
                "rank": 0,
                "outcome": "success",
                "status": 200,
                "detail": None,
                "duration_s": record["attempts"][0]["duration_s"],
                "stage": None,
                "output_tokens": None,  # a JSON answer
            }
        ]
        assert {"decided", "first_byte", "done"} <= set(record["timings"])

    h.run(main())


def test_proxy_follows_weight_table(h: Harness, shm_name: str) -> None:
    """A published table steers traffic; a zero-weight row then yields 503 (no engine)."""

    async def main() -> None:
        names = ["engine-0", "engine-1", "engine-2"]
        ids = [engine_id(n) for n in names]
        key = class_key("local", h.MODEL, "default")
        with TableWriter(shm_name, max_engines=8, max_classes=8) as writer:
            writer.publish(ids, [[0.0, 0.0, 5.0]], class_keys=[key], retry_ratio=0.05)
            async with h.proxy_stack(3, table_name=shm_name) as st, aiohttp.ClientSession() as s:
                async with s.get(st.url + "/ready") as resp:
                    ready = await resp.json()
                assert ready == {
                    "ready": True,
                    "weights": "table",
                    "generation": 1,
                    "unserved_models": [],
                }
                for i in range(10):
                    engine = await _engine_of(s, st.url, h.chat_body(f"q{i}"))
                    assert engine == "engine-2"
                writer.publish(ids, [[0.0, 0.0, 0.0]], class_keys=[key])
                await h.wait_until(lambda: st.ctx.fleet.state.generation == 2, timeout=5.0)
                async with s.post(st.url + "/v1/chat/completions", json=h.chat_body("q")) as resp:
                    assert resp.status == 503
                    body = await resp.json()
                assert body["error"]["code"] == "no_engine_available"
                async with s.get(st.url + "/metrics") as resp:
                    assert "fastroute_proxy_table_generation 2.0" in await resp.text()
            writer.unlink()

    h.run(main())
