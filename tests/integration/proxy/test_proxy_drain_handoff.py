"""Drain hand-off: a long stream on an engine drained through the admin API continues on
the next ranked engine in the same client stream, and the drained engine aborts it.

A proxy started from a config file (the admin API writes its engines state file next to
it and reloads itself); two emulated engines. Each test's long stream runs on the engine
ranked first for its session, slowed down (so it is mid-way when the drain comes), and is
checked against the same request served whole (the emulator's text depends on the
request only, and a continuation goes on where the partial output stopped).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from proxy_harness import MODEL, SHORT_OUTPUTS, Harness, Stack, config_toml
from test_proxy_migration import ENDPOINTS, StreamResult, body_of, ranking, record_of, stream

from fastroute.config import decode_config
from fastroute.emulator.server import EmulatedFleet, fleet_specs
from fastroute.hashing import class_key, engine_id
from fastroute.proxy.proxy_app import ProxyApp
from fastroute.tables import FLAG_DRAINING, TableWriter
from fastroute.testing.servers import serve_proxy_app
from fastroute.testing.waiting import wait_until

pytestmark = pytest.mark.integration

#: Output tokens of the long stream.
LONG_TOKENS = 400
#: Tokens the client reads before the engine is drained.
DRAIN_AFTER = 20
#: The slowed engine's step time factor: 400 tokens would take it tens of seconds.
SLOW = 8.0


@contextlib.asynccontextmanager
async def drain_stack(tmp_path: Path, extra: str = "") -> AsyncIterator[Stack]:
    """Two emulated engines behind a proxy started from ``tmp_path/fastroute.toml``."""
    specs = fleet_specs(2, model_name=MODEL, profile="h100", output_lengths=SHORT_OUTPUTS)
    async with EmulatedFleet(specs) as fleet:
        path = tmp_path / "fastroute.toml"
        path.write_text(config_toml(fleet.urls, extra))
        config = decode_config(path.read_text(), source=str(path))
        app = ProxyApp(config, config_path=path)
        async with serve_proxy_app(app) as (url, server):
            yield Stack(fleet, config, app, url, server)


def long_body(**extra: Any) -> dict[str, Any]:
    return {**body_of("chat"), "max_tokens": LONG_TOKENS, **extra}


async def drain(st: Stack, engine: str) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{st.url}/admin/engines/{engine}/drain") as resp:
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["state"] == "draining"


async def stream_with_drain(
    st: Stack, body: dict[str, Any], sid: str, engine: str | Callable[[], Awaitable[None]]
) -> StreamResult:
    """Stream ``body``; once :data:`DRAIN_AFTER` tokens arrived, drain ``engine`` through
    the admin API (or call it); read on to the end."""
    drained = False
    async with aiohttp.ClientSession() as s:
        async with s.post(
            st.url + ENDPOINTS["chat"], json=body, headers={"x-session-id": sid}
        ) as resp:
            out = StreamResult(resp.status, resp.headers["x-request-id"])
            async for raw in resp.content:
                line = raw.strip()
                if not line:
                    continue
                if line == b"data: [DONE]":
                    out.n_done += 1
                    continue
                out.events.append(json.loads(line[6:]))
                if not drained and len(out.text.split()) >= DRAIN_AFTER:
                    drained = True
                    await (drain(st, engine) if isinstance(engine, str) else engine())
    assert drained
    return out


async def migrations(st: Stack) -> dict[str, float]:
    """``fastroute_proxy_migrations_total`` by reason, from the proxy's ``/metrics``."""
    async with aiohttp.ClientSession() as s, s.get(st.url + "/metrics") as resp:
        text = await resp.text()
    prefix = 'fastroute_proxy_migrations_total{reason="'
    counts = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            reason, _, value = line[len(prefix) :].partition('"} ')
            counts[reason] = float(value)
    return counts


def test_a_long_stream_leaves_a_drained_engine(h: Harness, tmp_path: Path) -> None:
    """The client gets exactly the whole-served text in one stream; the record shows two
    segments, the first ended by the drain; the drained engine aborted the request after
    a fraction of its tokens."""

    async def main() -> None:
        extra = "\n[retry]\ndrain_handoff_after_s = 0\n"
        async with drain_stack(tmp_path, extra) as st:
            sid = "sid-drain"
            first, second = ranking(st, sid, 2)
            reference = await stream(st, "chat", long_body(), sid)
            assert len(reference.text.split()) == LONG_TOKENS
            a = st.fleet[first]
            finished_before = dict(a.model.finished_total)
            await a.set_faults(slowdown=SLOW)
            got = await stream_with_drain(st, long_body(), sid, f"engine-{first}")
            assert got.status == 200 and not got.errors and got.n_done == 1
            assert got.text == reference.text
            assert len({e["id"] for e in got.events}) == 1
            assert got.usage is not None and got.usage["completion_tokens"] == LONG_TOKENS
            record = await record_of(st, got.request_id)
            segments = record["segments"]
            assert [s["engine"] for s in segments] == [f"engine-{first}", f"engine-{second}"]
            assert [s["ended"] for s in segments] == ["drain", "success"]
            assert segments[0]["outcome"] == "drained"
            assert sum(s["tokens"] for s in segments) == LONG_TOKENS
            assert DRAIN_AFTER <= segments[0]["tokens"] < LONG_TOKENS // 2
            assert record["error"] is None and record["not_migrated"] is None
            # The drained engine aborted the request: nothing in flight, no finish there.
            await wait_until(lambda: a.model.num_running == 0)
            assert a.model.finished_total["abort"] == finished_before["abort"] + 1
            assert a.model.finished_total["length"] == finished_before["length"]
            assert await migrations(st) == {"drain": 1.0}

    h.run(main())


def test_a_stream_that_cannot_be_continued_stays_and_completes(h: Harness, tmp_path: Path) -> None:
    """``logprobs`` cannot be continued: the stream stays on the drained engine and
    finishes there; the record says why it stayed."""

    async def main() -> None:
        extra = "\n[retry]\ndrain_handoff_after_s = 0\n"
        async with drain_stack(tmp_path, extra) as st:
            sid = "sid-stays"
            first, _ = ranking(st, sid, 2)
            body = long_body(max_tokens=60, logprobs=True, top_logprobs=1)
            reference = await stream(st, "chat", body, sid)
            a = st.fleet[first]
            await a.set_faults(slowdown=2.0)
            length_before = a.model.finished_total["length"]
            got = await stream_with_drain(st, body, sid, f"engine-{first}")
            assert got.status == 200 and not got.errors and got.n_done == 1
            assert got.text == reference.text
            record = await record_of(st, got.request_id)
            assert record["segments"] == []
            assert [x["engine"] for x in record["attempts"]] == [f"engine-{first}"]
            assert record["attempts"][0]["outcome"] == "success"
            assert "stays on draining engine" in record["not_migrated"]
            assert "logprobs" in record["not_migrated"]
            assert a.model.finished_total["length"] == length_before + 1
            assert await migrations(st) == {}

    h.run(main())


@pytest.mark.parametrize("after_s", [-1, 60])
def test_a_stream_ending_within_the_delay_or_with_hand_offs_off_stays(
    h: Harness, tmp_path: Path, after_s: int
) -> None:
    """``retry.drain_handoff_after_s = -1`` (never), or a stream that ends before the
    delay passed: the stream finishes on the drained engine."""

    async def main() -> None:
        extra = f"\n[retry]\ndrain_handoff_after_s = {after_s}\n"
        async with drain_stack(tmp_path, extra) as st:
            sid = "sid-never"
            first, _ = ranking(st, sid, 2)
            body = long_body(max_tokens=60)
            reference = await stream(st, "chat", body, sid)
            await st.fleet[first].set_faults(slowdown=2.0)
            got = await stream_with_drain(st, body, sid, f"engine-{first}")
            assert got.text == reference.text and got.n_done == 1
            record = await record_of(st, got.request_id)
            assert record["segments"] == [] and record["not_migrated"] is None
            assert [x["engine"] for x in record["attempts"]] == [f"engine-{first}"]
            assert await migrations(st) == {}

    h.run(main())


def test_a_stream_leaves_an_engine_the_weight_table_flags_draining(
    h: Harness, shm_name: str
) -> None:
    """The controller's table flags the engine draining: the stream hands off as well."""

    async def main() -> None:
        ids = [engine_id(f"engine-{i}") for i in range(2)]
        key = class_key("local", MODEL, "default")
        extra = "\n[retry]\ndrain_handoff_after_s = 0\n"
        with TableWriter(shm_name, max_engines=8, max_classes=8) as writer:
            writer.publish(ids, [[1.0, 1.0]], class_keys=[key])
            async with h.proxy_stack(2, table_name=shm_name, extra=extra) as st:
                sid = "sid-table"
                first, second = ranking(st, sid, 2)
                body = long_body(max_tokens=120)
                reference = await stream(st, "chat", body, sid)
                await st.fleet[first].set_faults(slowdown=SLOW)
                flags = [FLAG_DRAINING if i == first else 0 for i in range(2)]

                async def flag() -> None:
                    writer.publish(ids, [[1.0, 1.0]], class_keys=[key], engine_flags=flags)

                got = await stream_with_drain(st, body, sid, flag)
                assert got.text == reference.text and got.n_done == 1 and not got.errors
                record = await record_of(st, got.request_id)
                assert [s["engine"] for s in record["segments"]] == [
                    f"engine-{first}",
                    f"engine-{second}",
                ]
                assert record["segments"][0]["ended"] == "drain"
                assert await migrations(st) == {"drain": 1.0}
            writer.unlink()

    h.run(main())
