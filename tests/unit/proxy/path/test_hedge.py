"""The hedge rule in isolation: its delay, when it is refused (runner-up, shedding,
budget), which engine it goes to, and how a race is settled (fake attempts)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from fastroute.config import decode_config
from fastroute.guards.outlier import Outcome
from fastroute.policy import Decision
from fastroute.proxy.http.reply import Reply
from fastroute.proxy.http.upstream import UpstreamError
from fastroute.proxy.path.decisions import Attempt, DecisionRecord
from fastroute.proxy.path.forward import Forwarder
from fastroute.proxy.path.headers import HeaderRelay
from fastroute.proxy.path.hedge import GatedSink, HedgeDelays, hedge_refusal
from fastroute.proxy.path.outcomes import Retryable
from fastroute.proxy.path.request_state import RequestState
from fastroute.proxy.path.requests import parse_chat
from fastroute.proxy.proxy_app import build_context

_ENGINES = "".join(
    f'[[engines]]\nname = "e{i}"\nurl = "http://127.0.0.1:{9000 + i}"\nmodels = ["m"]\n\n'
    for i in range(3)
)
_CLASS = '[[classes]]\nname = "c"\nmodel = "m"\nttft_slo_s = 0.2\nhedge = true\n'


def _ctx(extra: str = "") -> Any:
    return build_context(decode_config(_ENGINES + _CLASS + extra), None, None)


class _Sink:
    """Records what reached the client."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    async def start(self, status: int, headers: Any, raw_head: bytes = b"") -> None:
        self.calls.append(("start", status))

    async def write(self, data: bytes) -> None:
        self.calls.append(("write", data))

    async def end(self) -> None:
        self.calls.append(("end", None))

    def splice(self) -> None:
        return None


def _state(ctx: Any, sink: _Sink) -> RequestState:
    record = DecisionRecord(request_id="r1", endpoint="/v1/chat/completions")
    state = RequestState(None, "chat", b"{}", sink, record, asyncio.get_running_loop(), 0.0)  # type: ignore[arg-type]
    state.parsed = parse_chat(b'{"model": "m", "stream": true, "messages": []}')
    state.cls = ctx.config.classes[0]
    state.fleet = ctx.fleet
    state.row = 0
    return state


# -- the delay ----------------------------------------------------------------------------


def test_the_delay_is_the_slo_before_samples_then_the_quantile_bounded_by_the_floor() -> None:
    config = decode_config(_ENGINES + _CLASS + "[retry]\nhedge_min_samples = 20\n")
    cls = config.classes[0]
    delays = HedgeDelays(config.retry)
    assert delays.delay_s(cls) == pytest.approx(0.2)  # ttft_slo_s before 20 samples
    for i in range(100):  # first tokens 10 ms .. 1 s: the conformal p95 is the 96th
        delays.observe(cls, (i + 1) / 100)
    assert delays.delay_s(cls) == pytest.approx(0.96)
    for _ in range(config.retry.hedge_window):  # all fast now: the floor bounds it
        delays.observe(cls, 0.001)
    assert delays.delay_s(cls) == pytest.approx(config.retry.hedge_floor_s)
    floored = msgspec.structs.replace(cls, hedge_floor_s=0.5)
    assert delays.delay_s(floored) == pytest.approx(0.5)


def test_the_quantile_sets_how_deep_in_the_tail_the_hedge_fires() -> None:
    got = {}
    for q in (0.9, 0.95, 0.99):
        config = decode_config(_ENGINES + _CLASS + f"[retry]\nhedge_quantile = {q}\n")
        delays = HedgeDelays(config.retry)
        for i in range(500):
            delays.observe(config.classes[0], (i + 1) / 500)
        got[q] = delays.delay_s(config.classes[0])
    assert got[0.9] < got[0.95] < got[0.99] <= 1.0


# -- refusals -----------------------------------------------------------------------------


def test_refused_without_a_runner_up_or_while_the_controller_sheds() -> None:
    async def main() -> None:
        ctx = _ctx()
        state = _state(ctx, _Sink())
        assert hedge_refusal(ctx, state, (1,)) == "no runner-up engine"
        assert hedge_refusal(ctx, state, (1, 1)) == "no runner-up engine"
        ctx.fleet.state.shed_fraction[0] = 0.01
        assert hedge_refusal(ctx, state, (1, 2)) == "the controller sheds the class"
        ctx.fleet.state.shed_fraction[0] = 0.0
        assert hedge_refusal(ctx, state, (1, 2)) is None

    asyncio.run(main())


def test_each_hedge_takes_a_retry_from_the_budget() -> None:
    async def main() -> None:
        ctx = _ctx("[retry]\nratio = 0.0\nmin_retries_per_s = 0.2\nttl_s = 10.0\n")
        state = _state(ctx, _Sink())
        verdicts = [hedge_refusal(ctx, state, (0, 1)) for _ in range(5)]
        assert verdicts == [None, None] + ["refused by the retry budget"] * 3  # 0.2/s × 10 s

    asyncio.run(main())


# -- races (fake attempts) ----------------------------------------------------------------


def _race(first_token_s: dict[int, float | None], ranked: tuple[int, ...] = (2, 0, 1)) -> Any:
    """try_ranked of a hedged stream whose engine ``i`` sends its role event at once and
    its first token after ``first_token_s[i]`` seconds (None: fails before any byte at
    once; negative: fails before any byte after that many seconds)."""

    async def main() -> Any:
        ctx = _ctx("[retry]\nhedge_min_samples = 10000\n")  # delay: the SLO, 0.2 s
        sink = _Sink()
        state = _state(ctx, sink)
        tried: list[int] = []
        cancelled: list[int] = []

        async def attempt(st: RequestState, rank: int, index: int) -> Reply:
            tried.append(index)
            st.record.attempts.append(Attempt(engine=f"e{index}", rank=rank))
            delay = first_token_s[index]
            try:
                if delay is None or delay < 0:
                    await asyncio.sleep(0.01 if delay is None else -delay)
                    raise Retryable(UpstreamError(Outcome.CONNECT_ERROR, f"e{index} refused"))
                await st.sink.start(200, [])
                await st.sink.write(b"role ")
                await asyncio.sleep(delay)
                if st.hedge is not None and not st.hedge.first_token(0.0):
                    raise AssertionError("a loser was not cancelled before its token")
                await st.sink.write(f"token-from-e{index} ".encode())
                await st.sink.end()
            except asyncio.CancelledError:
                cancelled.append(index)
                raise
            st.record.attempts[-1].outcome = "success"
            return Reply(200, [], streamed=True)

        forwarder = Forwarder(ctx, HeaderRelay(False))
        forwarder.attempt = attempt  # type: ignore[method-assign]
        forwarder.hedger.attempt = attempt
        forwarder.deposit(ctx.fleet.state)
        decision = Decision(ranked=ranked, engine_ids=(0,) * len(ranked), policy="p", reason="r")
        reply = await forwarder.try_ranked(state, decision)
        return reply, tried, cancelled, sink.calls, state.record, ctx

    return asyncio.run(main())


def test_a_slow_first_engine_is_hedged_to_the_runner_up_which_wins() -> None:
    reply, tried, cancelled, calls, record, ctx = _race({2: 2.0, 0: 0.01, 1: 0.01})
    assert tried == [2, 0] and cancelled == [2]  # the runner-up of (2, 0, 1) is 0
    assert calls == [("start", 200), ("write", b"role "), ("write", b"token-from-e0 "),
                     ("end", None)]  # fmt: skip
    assert record.hedge["sent"] and record.hedge["winner"] == "e0"
    assert record.hedge["outcome"] == "won" and record.attempts[-1].engine == "e0"
    assert record.attempts[0].outcome == "hedge_cancelled"
    assert ctx.metrics.hedges.labels("won")._value.get() == 1


def test_the_first_engine_still_wins_when_its_token_comes_first() -> None:
    reply, tried, cancelled, calls, record, _ = _race({2: 0.25, 0: 1.0, 1: 1.0})
    assert tried == [2, 0] and cancelled == [0]
    assert ("write", b"token-from-e2 ") in calls and len(calls) == 4
    assert record.hedge["outcome"] == "lost" and record.hedge["winner"] == "e2"


def test_no_hedge_when_the_first_token_beats_the_delay() -> None:
    reply, tried, cancelled, calls, record, ctx = _race({2: 0.01, 0: 0.01, 1: 0.01})
    assert tried == [2] and cancelled == [] and record.hedge["sent"] is False
    assert ctx.metrics.retries._value.get() == 0


def test_a_first_engine_failing_early_is_retried_as_without_hedging() -> None:
    reply, tried, _, calls, record, _ = _race({2: None, 0: 0.01, 1: 0.01})
    assert tried == [2, 0] and record.hedge["sent"] is False
    assert ("write", b"token-from-e0 ") in calls


def test_a_hedge_failing_leaves_the_first_engine_to_answer() -> None:
    reply, tried, cancelled, calls, record, _ = _race({2: 0.4, 0: None, 1: 0.01})
    assert tried == [2, 0] and cancelled == []
    assert record.hedge["outcome"] == "lost" and ("write", b"token-from-e2 ") in calls


def test_both_failing_is_not_retried_again() -> None:
    # Both fail after the hedge went out: two attempts were made, max_retries is 1.
    reply, tried, _, calls, record, ctx = _race({2: -0.3, 0: -0.05, 1: 0.01})
    assert tried == [2, 0] and reply.status == 502 and calls == []
    assert record.hedge["outcome"] == "cancelled" and "winner" not in record.hedge
    assert ctx.metrics.hedges.labels("cancelled")._value.get() == 1


def test_a_gated_sink_holds_everything_until_it_opens() -> None:
    async def main() -> None:
        sink = _Sink()
        gated = GatedSink(sink, lambda: None)
        await gated.start(200, [])
        await gated.write(b"a")
        assert sink.calls == [] and gated.splice() is None
        gated.open = True
        await gated.write(b"b")
        await gated.end()
        assert sink.calls == [("start", 200), ("write", b"a"), ("write", b"b"), ("end", None)]

    asyncio.run(main())
