"""Mid-stream migration: an engine that dies mid-stream does not end the client's stream.

Each test kills a stream mid-way on the engine ranked first for its session (the
emulator's ``crash_after_tokens``: the connection is reset; ``stream_error_after_tokens``:
an in-stream error event) and checks what the client got against the same request
served whole by a healthy engine (the emulator's text depends on the request only, and a
continuation goes on where the partial output stopped).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from proxy_harness import (
    MODEL,
    SHORT_OUTPUTS,
    Harness,
    Stack,
    config_toml,
    decision_record,
    serve_proxy,
)

from fastroute.config import decode_config
from fastroute.emulator.server import EmulatedFleet, fleet_specs
from fastroute.hashing import key_hash
from fastroute.proxy.path.continuation import NOT_MIGRATED

pytestmark = pytest.mark.integration

#: Output tokens of every test request (``ignore_eos``: exactly this many).
MAX_TOKENS = 12
#: Tokens the faulty engine gives before it fails.
FAIL_AFTER = 4
FAULTS = ("crash_after_tokens", "stream_error_after_tokens")
ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass
class StreamResult:
    """What a client read of one SSE response."""

    status: int
    request_id: str
    events: list[dict[str, Any]] = field(default_factory=list)
    n_done: int = 0

    @property
    def text(self) -> str:
        parts = []
        for event in self.events:
            for choice in event.get("choices") or ():
                if "delta" in choice:
                    parts.append(choice["delta"].get("content") or "")
                else:
                    parts.append(choice.get("text") or "")
        return "".join(parts)

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [e["error"] for e in self.events if "error" in e]

    @property
    def usage(self) -> dict[str, Any] | None:
        usages = [e["usage"] for e in self.events if e.get("usage")]
        return usages[-1] if usages else None

    @property
    def role_events(self) -> int:
        return sum(
            1 for e in self.events for c in e.get("choices") or () if "role" in c.get("delta", {})
        )


def body_of(kind: str, *, usage: bool = True) -> dict[str, Any]:
    """A streamed request of ``kind`` that makes exactly :data:`MAX_TOKENS` tokens."""
    body: dict[str, Any] = {
        "model": MODEL,
        "stream": True,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
    }
    if usage:
        body["stream_options"] = {"include_usage": True}
    if kind == "chat":
        body["messages"] = [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "tell me a story"},
        ]
    else:
        body["prompt"] = "Once upon a time"
    return body


async def stream(st: Stack, kind: str, body: dict[str, Any], sid: str) -> StreamResult:
    """POST ``body`` to the proxy and read its SSE response to the end."""
    async with aiohttp.ClientSession() as s:
        async with s.post(
            st.url + ENDPOINTS[kind], json=body, headers={"x-session-id": sid}
        ) as resp:
            out = StreamResult(resp.status, resp.headers["x-request-id"])
            async for raw in resp.content:
                line = raw.strip()
                if not line:
                    continue
                assert line.startswith(b"data: "), line
                if line == b"data: [DONE]":
                    out.n_done += 1
                else:
                    out.events.append(json.loads(line[6:]))
    return out


async def record_of(st: Stack, rid: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s:
        return await decision_record(s, st.url, rid)


async def broken_streams(st: Stack) -> dict[str, float]:
    """``fastroute_proxy_broken_streams_total`` by outcome, from the proxy's ``/metrics``."""
    async with aiohttp.ClientSession() as s, s.get(st.url + "/metrics") as resp:
        text = await resp.text()
    prefix = 'fastroute_proxy_broken_streams_total{outcome="'
    counts = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            outcome, _, value = line[len(prefix) :].partition('"} ')
            counts[outcome] = float(value)
    return counts


def ranking(st: Stack, sid: str, n: int) -> list[int]:
    """The engines session ``sid`` is ranked on (config weights), best first."""
    fleet = st.ctx.fleet
    row = fleet.rows[(MODEL, "default")]
    return [int(i) for i in fleet.state.selector.rank(key_hash(sid), row, n)]


def assert_whole(got: StreamResult, reference: StreamResult, kind: str) -> None:
    """``got`` is one complete stream with the reference's text and token count."""
    assert got.status == 200
    assert not got.errors, got.errors
    assert got.n_done == 1
    assert got.text == reference.text and len(reference.text.split()) == MAX_TOKENS
    assert len({e["id"] for e in got.events}) == 1
    assert len({e["created"] for e in got.events}) == 1
    assert got.role_events == (1 if kind == "chat" else 0)
    assert got.usage is not None and reference.usage is not None
    assert got.usage["completion_tokens"] == reference.usage["completion_tokens"] == MAX_TOKENS
    assert got.usage["total_tokens"] == (
        got.usage["prompt_tokens"] + got.usage["completion_tokens"]
    )


def assert_clean_error(got: StreamResult, fault: str = "crash_after_tokens") -> None:
    """``got`` ended as a broken stream did before migration: after a crash, with the
    proxy's SSE error event and no ``[DONE]``; after an in-stream error, with the engine's
    own error event and ``[DONE]``."""
    assert got.status == 200
    assert len(got.errors) == 1 and "error" in got.events[-1]
    if fault == "crash_after_tokens":
        assert got.n_done == 0
        assert got.events[-1]["error"]["code"] == "upstream_error"
    else:
        assert got.n_done == 1
        assert got.events[-1]["error"]["type"] == "InternalServerError"
    assert all("choices" in e for e in got.events[:-1]) and len(got.events) >= 2


@pytest.mark.parametrize("kind", ["chat", "completions"])
@pytest.mark.parametrize("fault", FAULTS)
def test_broken_stream_continues_on_the_next_engine(h: Harness, kind: str, fault: str) -> None:
    """The client's stream completes with exactly the uninterrupted output; the decision
    record shows both segments."""

    async def main() -> None:
        async with h.proxy_stack(2) as st:
            sid = "sid-migrate"
            first, second = ranking(st, sid, 2)
            reference = await stream(st, kind, body_of(kind), sid)
            assert_whole(reference, reference, kind)
            await st.fleet[first].set_faults(**{fault: FAIL_AFTER})
            got = await stream(st, kind, body_of(kind), sid)
            assert_whole(got, reference, kind)
            record = await record_of(st, got.request_id)
            assert [s["engine"] for s in record["segments"]] == [
                f"engine-{first}",
                f"engine-{second}",
            ]
            assert [s["tokens"] for s in record["segments"]] == [
                FAIL_AFTER,
                MAX_TOKENS - FAIL_AFTER,
            ]
            assert record["segments"][0]["outcome"] != "success"
            assert record["segments"][1]["outcome"] == "success"
            assert record["error"] is None and record["status"] == 200
            assert await broken_streams(st) == {"migrated": 1.0}

    h.run(main())


def test_usage_not_asked_for_is_not_sent(h: Harness) -> None:
    """A client that did not ask for usage gets none after a migration either."""

    async def main() -> None:
        async with h.proxy_stack(2) as st:
            sid = "sid-no-usage"
            first, _ = ranking(st, sid, 2)
            reference = await stream(st, "chat", body_of("chat", usage=False), sid)
            await st.fleet[first].set_faults(crash_after_tokens=FAIL_AFTER)
            got = await stream(st, "chat", body_of("chat", usage=False), sid)
            assert got.text == reference.text and got.n_done == 1 and not got.errors
            assert got.usage is None and reference.usage is None

    h.run(main())


def test_migration_via_openai_client(h: Harness) -> None:
    """The official client reads a migrated stream as one ordinary stream."""

    async def main() -> None:
        async with h.proxy_stack(2) as st:
            for engine in st.fleet.engines:  # whichever the request goes to: one migration
                await engine.set_faults(crash_after_tokens=FAIL_AFTER)

            def read() -> tuple[str, set[str], Any]:
                chunks = list(
                    st.client().chat.completions.create(
                        model=MODEL,
                        messages=body_of("chat")["messages"],
                        max_tokens=2 * FAIL_AFTER,
                        stream=True,
                        stream_options={"include_usage": True},
                        extra_body={"ignore_eos": True},
                    )
                )
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                return text, {c.id for c in chunks}, chunks[-1].usage

            # Both engines fail after FAIL_AFTER tokens: 2 × FAIL_AFTER tokens complete
            # with one migration (the continuation needs only FAIL_AFTER more).
            text, ids, usage = await asyncio.to_thread(read)
            assert len(text.split()) == 2 * FAIL_AFTER
            assert len(ids) == 1
            assert usage.completion_tokens == 2 * FAIL_AFTER

    h.run(main())


@pytest.mark.parametrize("max_migrations", [1, 2])
def test_max_migrations(h: Harness, max_migrations: int) -> None:
    """The first two ranked engines break: one migration is not enough (clean SSE error,
    both segments in the record), two are (the third engine finishes the output)."""

    async def main() -> None:
        extra = f"\n[retry]\nmax_migrations = {max_migrations}\n"
        async with h.proxy_stack(3, extra=extra) as st:
            sid = "sid-max"
            order = ranking(st, sid, 3)
            reference = await stream(st, "chat", body_of("chat"), sid)
            for engine in order[:2]:
                await st.fleet[engine].set_faults(crash_after_tokens=FAIL_AFTER)
            got = await stream(st, "chat", body_of("chat"), sid)
            record = await record_of(st, got.request_id)
            engines = [s["engine"] for s in record["segments"]]
            if max_migrations == 1:
                assert_clean_error(got)
                assert engines == [f"engine-{i}" for i in order[:2]]
                assert got.text == reference.text[: len(got.text)]
                assert len(got.text.split()) == 2 * FAIL_AFTER
                assert record["not_migrated"] == "retry.max_migrations=1 reached"
                assert await broken_streams(st) == {"failed": 1.0}
            else:
                assert_whole(got, reference, "chat")
                assert engines == [f"engine-{i}" for i in order]
                assert await broken_streams(st) == {"migrated": 1.0}

    h.run(main())


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        (f'\n[[classes]]\nname = "chat"\nmodel = "{MODEL}"\nmigrate = false\n', None),
        ("\n[retry]\nratio = 0.0\nmin_retries_per_s = 0.0\n", "retry budget"),
        ("\n[retry]\nmax_migration_text_bytes = 64\n", None),
    ],
    ids=["class-migrate-false", "budget-exhausted", "over-text-bound"],
)
@pytest.mark.parametrize("fault", FAULTS)
def test_not_migrated_ends_with_clean_error(
    h: Harness, extra: str, why: str | None, fault: str
) -> None:
    """No migration (the class opts out, the retry budget is empty, the stream is over
    the bound of kept bytes): today's clean SSE error."""

    async def main() -> None:
        async with h.proxy_stack(2, extra=extra) as st:
            sid = "sid-no-migration"
            first, _ = ranking(st, sid, 2)
            await st.fleet[first].set_faults(**{fault: FAIL_AFTER})
            got = await stream(st, "chat", body_of("chat"), sid)
            assert_clean_error(got, fault)
            record = await record_of(st, got.request_id)
            assert len(record["attempts"]) == 1
            if why is not None:
                assert why in record["not_migrated"]
            assert await broken_streams(st) == {"not_migrated": 1.0}

    h.run(main())


@contextlib.asynccontextmanager
async def llamacpp_runner_up_stack() -> AsyncIterator[Stack]:
    """Two emulated engines; the proxy's config says engine-1 is a llama.cpp server."""
    specs = fleet_specs(2, model_name=MODEL, profile="h100", output_lengths=SHORT_OUTPUTS)
    async with EmulatedFleet(specs) as fleet:
        toml = config_toml(fleet.urls)
        head, sep, tail = toml.partition('name = "engine-1"\n')
        config = decode_config(head + sep + 'kind = "llamacpp"\n' + tail, source="test.toml")
        async with serve_proxy(config) as (app, url, server):
            yield Stack(fleet, config, app, url, server)


def test_llamacpp_engine_does_not_continue(h: Harness) -> None:
    """The only other engine is llama.cpp (no ``continue_final_message``): clean SSE error."""

    async def main() -> None:
        async with llamacpp_runner_up_stack() as st:
            sid = next(f"sid-{i}" for i in range(1000) if ranking(st, f"sid-{i}", 2)[0] == 0)
            await st.fleet[0].set_faults(crash_after_tokens=FAIL_AFTER)
            got = await stream(st, "chat", body_of("chat"), sid)
            assert_clean_error(got)
            record = await record_of(st, got.request_id)
            assert record["not_migrated"] == "no other ranked engine can continue it"

    h.run(main())


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("logprobs", True, NOT_MIGRATED["logprobs"]),
        ("response_format", {"type": "json_object"}, NOT_MIGRATED["guided"]),
    ],
)
def test_requests_that_cannot_be_continued(h: Harness, field: str, value: Any, why: str) -> None:
    """``logprobs`` and guided decoding are not migrated: clean SSE error (``n > 1``,
    refused by the emulator itself, is covered by the unit tests)."""

    async def main() -> None:
        async with h.proxy_stack(2) as st:
            sid = "sid-features"
            first, _ = ranking(st, sid, 2)
            await st.fleet[first].set_faults(crash_after_tokens=FAIL_AFTER)
            got = await stream(st, "chat", {**body_of("chat"), field: value}, sid)
            assert_clean_error(got)
            record = await record_of(st, got.request_id)
            assert record["not_migrated"] == why

    h.run(main())


def test_a_continuation_refused_before_its_first_byte_moves_on(h: Harness) -> None:
    """The runner-up refuses connections: that continuation fails before its first byte
    and counts as a migration; the third engine finishes the stream."""

    async def main() -> None:
        async with h.proxy_stack(3, extra="\n[retry]\nmax_migrations = 2\n") as st:
            sid = "sid-refused"
            order = ranking(st, sid, 3)
            reference = await stream(st, "chat", body_of("chat"), sid)
            await st.fleet[order[0]].set_faults(crash_after_tokens=FAIL_AFTER)
            await st.fleet[order[1]].set_faults(refuse_connections=True)
            got = await stream(st, "chat", body_of("chat"), sid)
            assert_whole(got, reference, "chat")
            record = await record_of(st, got.request_id)
            assert [a["engine"] for a in record["attempts"]] == [f"engine-{i}" for i in order]
            assert record["attempts"][1]["outcome"] == "connect_error"
            assert [s["engine"] for s in record["segments"]] == [
                f"engine-{order[0]}",
                f"engine-{order[2]}",
            ]

    h.run(main())
