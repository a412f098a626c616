"""Hedged first tokens: a stream of a ``hedge = true`` class whose first token has not
arrived after the hedge delay is also sent to the runner-up engine of its ranking.

Two attempts ("legs") then race, each with its own copy of the request state and a
:class:`GatedSink` in front of the client's sink: nothing of a leg reaches the client
(not even the status line) until it is the winner. The first leg whose stream carries
a **token** (the relay's first-token hook, so a role event does not count) wins, its
buffered bytes are flushed and the rest of its stream is relayed as usual; the other
leg's task is cancelled, which closes its engine connection (the engine aborts the
request). A leg that fails before any token drops out; a leg that ends without a token
(an error reply, an empty stream) wins if the other has not.

The hedge draws one retry from the retry budget (so hedges and retries together stay
within the budget's ratio plus floor) and is not sent while the controller sheds the
class, or when the ranking has no other engine. The delay is the ``retry.hedge_quantile``
of the class's recent client first-token times (:class:`HedgeDelays`), bounded below by
the class's ``hedge_floor_s`` or ``retry.hedge_floor_s``. Only chat and completions
streams are hedged: a non-streamed answer's headers come only when its whole output is
done, so a hedge on time-to-headers would duplicate whole decodes, not a prefill.
See docs/failure-handling.md, "Hedged first tokens".
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from fastroute.config import ClassConfig, RetryConfig
from fastroute.predict.conformal import ConformalBound
from fastroute.proxy.http.reply import Headers, Reply, Sink, Splice
from fastroute.proxy.path.decisions import Attempt
from fastroute.proxy.path.migration import Migrate, migration_for
from fastroute.proxy.path.outcomes import Retryable
from fastroute.proxy.path.request_state import RequestState

if TYPE_CHECKING:
    from fastroute.proxy.path.handler import ProxyContext
    from fastroute.proxy.path.migration import Migrator

__all__ = ["GatedSink", "HedgeDelays", "Hedger", "hedge_refusal"]

#: The endpoints whose streams may be hedged.
HEDGED_KINDS = frozenset({"chat", "completions"})
#: Most bytes a leg may buffer before its first token (a role event is ~200 bytes);
#: past it the leg claims the race (its stream has committed to something).
MAX_GATED_BYTES = 64 * 1024


class HedgeDelays:
    """The hedge delay of each hedged class, from its recent client first-token times.

    Parameters
    ----------
    retry : RetryConfig
        ``hedge_quantile``, ``hedge_floor_s``, ``hedge_window``, ``hedge_min_samples``.

    Bound: one window per class name seen (the config's classes).
    """

    def __init__(self, retry: RetryConfig) -> None:
        self.retry = retry
        self._bounds: dict[str, ConformalBound] = {}

    def _bound(self, cls: ClassConfig) -> ConformalBound:
        bound = self._bounds.get(cls.name)
        if bound is None:
            retry = self.retry
            bound = self._bounds[cls.name] = ConformalBound(
                retry.hedge_quantile,
                window=retry.hedge_window,
                min_samples=retry.hedge_min_samples,
                default_factor=cls.ttft_slo_s,
            )
        return bound

    def observe(self, cls: ClassConfig, ttft_s: float) -> None:
        """A client first-token time of class ``cls``, seconds from arrival."""
        self._bound(cls).add(ttft_s, 1.0)

    def delay_s(self, cls: ClassConfig) -> float:
        """How long a request of ``cls`` waits for its first token before its hedge."""
        floor_s = cls.hedge_floor_s if cls.hedge_floor_s is not None else self.retry.hedge_floor_s
        return max(floor_s, self._bound(cls).factor())


def hedge_refusal(ctx: ProxyContext, state: RequestState, ranked: Sequence[int]) -> str | None:
    """Why the request of ``state`` may not send its hedge now (None: it may; the budget
    has been charged one retry)."""
    fleet = state.fleet
    assert fleet is not None
    if len(ranked) < 2 or ranked[1] == ranked[0]:
        return "no runner-up engine"
    if fleet.engines[ranked[1]].name == fleet.engines[ranked[0]].name:
        return "the runner-up is the same engine"
    if float(fleet.state.shed_fraction[state.row]) > 0.0:
        return "the controller sheds the class"
    if not ctx.budget.try_withdraw(time.monotonic()):
        ctx.metrics.retry_refused.inc()
        return "refused by the retry budget"
    return None


class GatedSink:
    """A leg's view of the client's sink: buffered until the leg wins, then passed on.

    Parameters
    ----------
    sink : Sink
        The client's sink.
    on_overflow : callable
        Called when more than :data:`MAX_GATED_BYTES` were buffered (the leg claims).
    """

    __slots__ = ("sink", "on_overflow", "open", "_start", "_chunks", "_bytes", "_ended")

    def __init__(self, sink: Sink, on_overflow: Callable[[], None]) -> None:
        self.sink = sink
        self.on_overflow = on_overflow
        self.open = False
        self._start: tuple[int, Headers, bytes] | None = None
        self._chunks: list[bytes] = []
        self._bytes = 0
        self._ended = False

    async def start(self, status: int, headers: Headers, raw_head: bytes = b"") -> None:
        """Hold the status line until the leg wins."""
        if self.open:
            await self.sink.start(status, headers, raw_head)
        else:
            self._start = (status, headers, raw_head)

    async def write(self, data: bytes) -> None:
        """Hold ``data`` until the leg wins; once it has, flush and pass it on."""
        if not self.open:
            self._chunks.append(data)
            self._bytes += len(data)
            if self._bytes > MAX_GATED_BYTES:
                self.on_overflow()
            if not self.open:
                return
            data = b""
        await self.flush()
        if data:
            await self.sink.write(data)

    async def end(self) -> None:
        """Finish the body (held until the leg wins)."""
        self._ended = True
        if self.open:
            await self.flush()

    def splice(self) -> Splice | None:
        """The client's splice once the leg won and its buffer was flushed, else None
        (the relay then reads chunk by chunk through :meth:`write`)."""
        if self.open and self._start is None and not self._chunks:
            return self.sink.splice()
        return None

    async def flush(self) -> None:
        """Write what was held (the leg has won)."""
        start, self._start = self._start, None
        if start is not None:
            await self.sink.start(*start)
        chunks, self._chunks = self._chunks, []
        for chunk in chunks:
            if chunk:
                await self.sink.write(chunk)
        if self._ended:
            self._ended = False
            await self.sink.end()


class _Leg:
    """One attempt of a hedged race: its state copy, gated sink, task."""

    __slots__ = ("race", "rank", "index", "state", "sink", "task", "attempt_at", "started_s")

    def __init__(self, race: _Race, state: RequestState, rank: int, index: int) -> None:
        self.race = race
        self.rank = rank
        self.index = index
        self.sink = GatedSink(state.sink, self.claim)
        self.state = dataclasses.replace(state, sink=self.sink, hedge=self, migration=None)
        self.task: asyncio.Task[Reply] | None = None
        self.attempt_at = len(state.record.attempts)  # where its Attempt is appended
        self.started_s = state.loop.time()

    def first_token(self, now: float) -> bool:
        """The relay's hook: this leg's stream carried its first token at ``now``;
        True when the leg won the race with it."""
        del now
        self.claim()
        return self.race.winner is self

    def claim(self) -> None:
        """This leg wins unless the other did already (then it is being cancelled)."""
        self.race.claim(self)


class _Race:
    """The legs of one hedged request and which of them won."""

    __slots__ = ("legs", "winner")

    def __init__(self) -> None:
        self.legs: list[_Leg] = []
        self.winner: _Leg | None = None

    def claim(self, leg: _Leg) -> None:
        if self.winner is not None:
            return
        self.winner = leg
        leg.sink.open = True
        for other in self.legs:
            if other is not leg and other.task is not None:
                other.task.cancel()  # closes its engine connection: the engine aborts


AttemptFn = Callable[[RequestState, int, int], Awaitable[Reply]]


class Hedger:
    """Runs hedged races for one :class:`~fastroute.proxy.path.handler.ProxyContext`.

    Parameters
    ----------
    ctx : ProxyContext
    attempt : callable
        The forwarder's ``attempt(state, rank, index)``.
    migrator : Migrator
        Continues a winner whose stream breaks after its first token.
    """

    def __init__(self, ctx: ProxyContext, attempt: AttemptFn, migrator: Migrator) -> None:
        self.ctx = ctx
        self.attempt = attempt
        self.migrator = migrator
        self.delays = HedgeDelays(ctx.config.retry)

    def applies(self, state: RequestState) -> bool:
        """The request is a stream of a hedged class (and not a P/D stage)."""
        cls, parsed = state.cls, state.parsed
        return (
            cls is not None
            and cls.hedge
            and parsed is not None
            and parsed.stream
            and state.stage is None
            and state.kind in HEDGED_KINDS
        )

    async def race(self, state: RequestState, ranked: Sequence[int]) -> Reply:
        """Attempt ``ranked[0]``; after the delay without a first token also
        ``ranked[1]``. Raises ``Retryable`` when every leg sent failed before a token
        (``state.record.hedge["sent"]`` tells the forwarder where to go on)."""
        assert state.cls is not None
        delay_s = self.delays.delay_s(state.cls)
        info: dict[str, Any] = {"delay_s": round(delay_s, 4), "sent": False}
        state.record.hedge = info
        race = _Race()
        try:
            primary = self._start(race, state, 0, ranked[0])
            done, _ = await asyncio.wait({primary.task}, timeout=delay_s)  # type: ignore[arg-type]
            if not done and race.winner is None:
                self._hedge(state, race, ranked, info)
            return await self._settle(state, race, ranked, info)
        finally:
            for leg in race.legs:
                if leg.task is not None and not leg.task.done():
                    leg.task.cancel()
            if info["sent"] and "outcome" not in info:
                # The client went away before the tally (one closing on [DONE] can): the
                # first token still decided the race.
                self._count_outcome(race, info)
            await asyncio.gather(
                *(leg.task for leg in race.legs if leg.task is not None), return_exceptions=True
            )

    def _start(self, race: _Race, state: RequestState, rank: int, index: int) -> _Leg:
        leg = _Leg(race, state, rank, index)
        leg.state.migration = migration_for(self.ctx, leg.state)
        leg.task = asyncio.ensure_future(self.attempt(leg.state, rank, index))
        race.legs.append(leg)
        return leg

    def _hedge(
        self, state: RequestState, race: _Race, ranked: Sequence[int], info: dict[str, Any]
    ) -> None:
        """The delay passed without a first token: send the hedge, or say why not."""
        refusal = hedge_refusal(self.ctx, state, ranked)
        if refusal is not None:
            info["refused"] = refusal
            self.ctx.metrics.hedges.labels("refused").inc()
            return
        assert state.fleet is not None
        self.ctx.metrics.retries.inc()
        info["sent"] = True
        info["runner_up"] = state.fleet.engines[ranked[1]].name
        self._start(race, state, 1, ranked[1])

    async def _settle(
        self, state: RequestState, race: _Race, ranked: Sequence[int], info: dict[str, Any]
    ) -> Reply:
        """Wait for the race's outcome and the winner's whole stream."""
        pending = [leg for leg in race.legs]
        failure: Retryable | None = None
        while pending:
            tasks = {leg.task for leg in pending if leg.task is not None}
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for leg in list(pending):
                task = leg.task
                assert task is not None
                if not task.done():
                    continue
                pending.remove(leg)
                if task.cancelled():
                    continue  # the other leg won
                exc = task.exception()
                if isinstance(exc, Retryable) and race.winner is not leg:
                    failure = exc
                    continue
                race.claim(leg)  # a reply (or a broken stream) without a token: it wins
                if race.winner is not leg:
                    continue
                return await self._finish(state, race, ranked, info, leg)
        self._tally(state, race, info)
        assert failure is not None
        raise failure

    async def _finish(
        self,
        state: RequestState,
        race: _Race,
        ranked: Sequence[int],
        info: dict[str, Any],
        leg: _Leg,
    ) -> Reply:
        """The winning leg's result: its reply, or its broken stream continued."""
        assert leg.task is not None
        for other in race.legs:  # the loser's connection is closed before we go on
            if other is not leg and other.task is not None:
                other.task.cancel()
                await asyncio.gather(other.task, return_exceptions=True)
        self._tally(state, race, info)
        exc = leg.task.exception()
        if exc is None:
            await leg.sink.flush()
            return leg.task.result()
        if isinstance(exc, Migrate):
            state.migration = leg.state.migration
            return await self.migrator.resume(leg.state, ranked, leg.rank, exc.failure)
        raise exc

    def _tally(self, state: RequestState, race: _Race, info: dict[str, Any]) -> None:
        """The race into the decision record, the metrics and the delay window."""
        record, winner = state.record, race.winner
        attempts = record.attempts
        for leg in race.legs:
            if leg is not winner and leg.attempt_at < len(attempts):
                attempt = attempts[leg.attempt_at]
                if attempt.outcome == "pending":
                    attempt.outcome = "hedge_cancelled"
        if winner is not None and winner.attempt_at < len(attempts):
            # The winner's attempt last: the record's and the metrics' "engine" is its.
            won: Attempt = attempts.pop(winner.attempt_at)
            attempts.append(won)
            info["winner"] = won.engine
        first_token = record.timings.get("first_token")
        if state.cls is not None and first_token is not None and winner is not None:
            self.delays.observe(state.cls, first_token)
        if info["sent"]:
            self._count_outcome(race, info)

    def _count_outcome(self, race: _Race, info: dict[str, Any]) -> None:
        """A sent hedge's outcome into the decision record and the metric, once: ``won``
        (its first token came first), ``lost`` (the primary's did) or ``cancelled`` (neither
        leg had one when the request ended)."""
        if race.winner is None:
            outcome = "cancelled"
        else:
            outcome = "won" if race.winner.rank == 1 else "lost"
        info["outcome"] = outcome
        self.ctx.metrics.hedges.labels(outcome).inc()
