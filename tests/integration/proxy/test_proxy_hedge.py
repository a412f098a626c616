"""Hedged first tokens against real emulated engines: one engine is slowed (the
emulator's ``slowdown`` fault), so a request ranked on it first is hedged to the
runner-up, whose token wins; the slow engine's request is aborted (its connection was
closed), and the client reads one clean stream."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from proxy_harness import MODEL, Harness, Stack
from test_proxy_migration import StreamResult, body_of, ranking, record_of, stream

pytestmark = pytest.mark.integration

#: The slowed engine's step-time multiplier: its first token takes well over a second,
#: the healthy engine's a few tens of milliseconds.
SLOWDOWN = 60.0
#: The hedged class's delay before any first-token time is known: its ``ttft_slo_s``.
DELAY_S = 0.15


def hedged_config(extra_retry: str = "") -> str:
    """A hedged default class (no samples needed: ``hedge_min_samples`` is high, so the
    delay is the class's ``ttft_slo_s``), admission off (its target follows the SLO)."""
    return (
        f'\n[[classes]]\nname = "chat"\nmodel = "{MODEL}"\npriority = "default"\n'
        f"ttft_slo_s = {DELAY_S}\nhedge = true\n"
        "\n[admission]\nenabled = false\n"
        f"\n[retry]\nhedge_min_samples = 10000\n{extra_retry}"
    )


async def hedges(st: Stack) -> dict[str, float]:
    """``fastroute_proxy_hedges_total`` by outcome, from the proxy's ``/metrics``."""
    async with aiohttp.ClientSession() as s, s.get(st.url + "/metrics") as resp:
        text = await resp.text()
    prefix = 'fastroute_proxy_hedges_total{outcome="'
    counts = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            outcome, _, value = line[len(prefix) :].partition('"} ')
            counts[outcome] = float(value)
    return counts


def assert_one_clean_stream(got: StreamResult, reference: StreamResult) -> None:
    """One id, one role event, one ``[DONE]``, the whole text, no error."""
    assert got.status == 200
    assert not got.errors, got.errors
    assert got.n_done == 1
    assert got.role_events == 1
    assert len({e["id"] for e in got.events}) == 1
    assert got.text == reference.text


def test_the_hedge_wins_against_a_slow_engine(h: Harness) -> None:
    """The slow engine is ranked first: after the delay the runner-up gets the request,
    its stream is the client's, and the slow engine aborts its own."""

    async def main() -> None:
        async with h.proxy_stack(2, extra=hedged_config()) as st:
            sid = "sid-hedge"
            first, second = ranking(st, sid, 2)
            reference = await stream(st, "chat", body_of("chat"), sid)
            slow = st.fleet[first]
            await slow.set_faults(slowdown=SLOWDOWN)
            aborts = slow.model.finished_total["abort"]
            got = await stream(st, "chat", body_of("chat"), sid)
            assert_one_clean_stream(got, reference)
            record = await record_of(st, got.request_id)
            hedge = record["hedge"]
            assert hedge["sent"] is True and hedge["delay_s"] == pytest.approx(DELAY_S)
            assert hedge["runner_up"] == f"engine-{second}"
            assert hedge["winner"] == f"engine-{second}" and hedge["outcome"] == "won"
            engines = [(a["engine"], a["outcome"]) for a in record["attempts"]]
            assert engines == [
                (f"engine-{first}", "hedge_cancelled"),
                (f"engine-{second}", "success"),
            ]
            assert record["timings"]["first_token"] < 1.0  # the slow engine needs seconds
            assert await hedges(st) == {"won": 1.0}
            await h.wait_until(lambda: slow.model.finished_total["abort"] == aborts + 1, 5.0)
            assert slow.model.num_running == 0 and slow.model.num_waiting == 0

    h.run(main())


def test_no_hedge_when_the_first_token_is_on_time(h: Harness) -> None:
    """A healthy engine answers within the delay: nothing is sent to the runner-up."""

    async def main() -> None:
        async with h.proxy_stack(2, extra=hedged_config()) as st:
            reference = await stream(st, "chat", body_of("chat"), "sid-fast")
            got = await stream(st, "chat", body_of("chat"), "sid-fast")
            assert_one_clean_stream(got, reference)
            record = await record_of(st, got.request_id)
            assert record["hedge"]["sent"] is False and len(record["attempts"]) == 1
            assert await hedges(st) == {}
            prompt_tokens = [e.model.prompt_tokens_total for e in st.fleet.engines]
            assert sorted(prompt_tokens)[0] == 0  # the other engine never prefilled

    h.run(main())


def test_the_retry_budget_caps_hedges(h: Harness) -> None:
    """With ratio 0 and a floor of 0.3 retries/s over 10 s, at most 3 of 10 slow
    requests are hedged: attempts ≤ requests × (1 + ratio) + floor × ttl."""
    n_requests, floor_rps, ttl_s = 10, 0.3, 10.0

    async def main() -> None:
        extra = f"ratio = 0.0\nmin_retries_per_s = {floor_rps}\nttl_s = {ttl_s}\n"
        async with h.proxy_stack(2, extra=hedged_config(extra)) as st:
            sid = "sid-budget"
            first, _ = ranking(st, sid, 2)
            await st.fleet[first].set_faults(slowdown=SLOWDOWN / 4)
            reference = await stream(st, "chat", body_of("chat"), "sid-reference")
            got = await asyncio.gather(
                *(stream(st, "chat", body_of("chat"), sid) for _ in range(n_requests))
            )
            records: list[dict[str, Any]] = [await record_of(st, g.request_id) for g in got]
            for g in got:
                assert g.status == 200 and g.n_done == 1 and not g.errors
                assert g.text == reference.text
            attempts = sum(len(r["attempts"]) for r in records)
            assert attempts <= n_requests * (1 + 0.0) + floor_rps * ttl_s
            counts = await hedges(st)
            sent = counts.get("won", 0) + counts.get("lost", 0) + counts.get("cancelled", 0)
            assert sent == int(floor_rps * ttl_s)
            # The others were refused (a request whose first token beat the delay was
            # neither sent nor refused a hedge).
            assert 1 <= counts.get("refused", 0) <= n_requests - sent
            assert sum(r["hedge"]["sent"] for r in records) == sent
            refused = [r for r in records if "refused" in r["hedge"]]
            assert {r["hedge"]["refused"] for r in refused} == {"refused by the retry budget"}

    h.run(main(), timeout=60.0)


def test_a_hedged_stream_via_openai_client(h: Harness) -> None:
    """The official client reads a stream whose hedge won as one ordinary stream."""

    async def main() -> None:
        async with h.proxy_stack(2, extra=hedged_config()) as st:
            sid = "sid-openai"
            first, _ = ranking(st, sid, 2)
            await st.fleet[first].set_faults(slowdown=SLOWDOWN)

            def read() -> tuple[str, set[str], Any]:
                chunks = list(
                    st.client().chat.completions.create(
                        model=MODEL,
                        messages=body_of("chat")["messages"],
                        max_tokens=6,
                        stream=True,
                        stream_options={"include_usage": True},
                        extra_body={"ignore_eos": True},
                        extra_headers={"x-session-id": sid},
                    )
                )
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                return text, {c.id for c in chunks}, chunks[-1].usage

            text, ids, usage = await asyncio.to_thread(read)
            assert len(text.split()) == 6 and len(ids) == 1
            assert usage.completion_tokens == 6
            assert await hedges(st) == {"won": 1.0}

    h.run(main())


def test_a_client_leaving_after_the_first_token_keeps_the_hedges_outcome(h: Harness) -> None:
    """The first token decided the race: a client that closes the stream after it (as a
    client closing on ``[DONE]`` can, before the proxy's tally) counts as ``won``, not
    ``cancelled`` (one clean make-test run counted it ``cancelled``)."""

    async def main() -> None:
        async with h.proxy_stack(2, extra=hedged_config()) as st:
            sid = "sid-leaves"
            first, second = ranking(st, sid, 2)
            await st.fleet[first].set_faults(slowdown=SLOWDOWN)
            body = {**body_of("chat"), "max_tokens": 200}  # still streaming when it leaves
            async with aiohttp.ClientSession() as s:
                async with s.post(
                    st.url + "/v1/chat/completions", json=body, headers={"x-session-id": sid}
                ) as resp:
                    assert resp.status == 200
                    rid = resp.headers["x-request-id"]
                    async for raw in resp.content:
                        if raw.startswith(b"data: {"):
                            break  # the winner's first event: leave mid-stream
                    resp.close()
            await h.wait_until(lambda: _has_outcome(st), 5.0)
            assert await hedges(st) == {"won": 1.0}
            record = await record_of(st, rid)
            assert record["hedge"]["outcome"] == "won"
            assert record["hedge"]["runner_up"] == f"engine-{second}"

    h.run(main())


async def _has_outcome(st: Stack) -> bool:
    counts = await hedges(st)
    return sum(v for k, v in counts.items() if k != "refused") > 0
