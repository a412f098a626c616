"""Forwarding a decided request: the ranked engines in order, one attempt each, retries
within the retry budget.

An attempt that fails before any byte reached the client (connect error, timeout, a
status in ``retry.retry_on_status``) raises :class:`~fastroute.proxy.path.outcomes.Retryable`
and the next ranked engine is tried if ``retry.max_retries`` and the retry budget
allow; otherwise the client gets 502 (connect error, disconnect, 5xx), 504 (timeout)
or the engine's 4xx/429 in OpenAI shape. A stream that breaks after bytes reached the
client raises :class:`~fastroute.proxy.path.migration.Migrate` and is continued on the
engines ranked after it (:class:`~fastroute.proxy.path.migration.Migrator`). The same
loop forwards a whole request and each stage of a P/D request (the stage is the request
state's ``fleet``, ``strategy``, ``route``, ``body`` and ``sink``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from fastroute.guards.outlier import Outcome
from fastroute.policy import Decision
from fastroute.proxy.http.http1 import Response
from fastroute.proxy.http.openai_errors import error_reply
from fastroute.proxy.http.reply import Reply
from fastroute.proxy.http.upstream import UpstreamError
from fastroute.proxy.path.decisions import Attempt
from fastroute.proxy.path.headers import HeaderRelay, decision_headers
from fastroute.proxy.path.hedge import Hedger
from fastroute.proxy.path.migration import Migrate, Migrator, migration_for
from fastroute.proxy.path.outcomes import Retryable, record_outcome
from fastroute.proxy.path.relay import Relay
from fastroute.proxy.path.request_state import RequestState
from fastroute.signals.reports import completion_tokens_of
from fastroute.tables.stats import Ewma

if TYPE_CHECKING:
    from fastroute.proxy.path.fleet import FleetState
    from fastroute.proxy.path.handler import ProxyContext

__all__ = ["Forwarder"]


class Forwarder:
    """Forwards decided requests of one :class:`~fastroute.proxy.path.handler.ProxyContext`.

    Parameters
    ----------
    ctx : ProxyContext
    headers : HeaderRelay
        The handler's header verdicts (both directions).
    """

    def __init__(self, ctx: ProxyContext, headers: HeaderRelay) -> None:
        self.ctx = ctx
        self.headers = headers
        self.relay = Relay(ctx, headers)
        self.migrator = Migrator(ctx, self.attempt)
        self.relay.migrator = self.migrator  # plans drain hand-offs
        self.hedger = Hedger(ctx, self.attempt, self.migrator)
        self._budget_state: FleetState | None = None  # the state the budget's ratio is from

    def deposit(self, state: FleetState) -> None:
        """One retry-budget deposit for a request about to be forwarded."""
        budget = self.ctx.budget
        if state is not self._budget_state:  # the ratio changes only with the table
            self._budget_state = state
            ratio = self.ctx.config.retry.ratio
            budget.set_ratio(ratio if state.retry_ratio is None else min(ratio, state.retry_ratio))
        budget.deposit(time.monotonic())

    async def try_ranked(self, state: RequestState, decision: Decision) -> Reply:
        """Attempt the ranked engines of ``state.fleet`` in order, retries within the
        budget; the stage's strategy tracks each attempt."""
        ctx = self.ctx
        record = state.record
        last: UpstreamError | Reply | None = None
        state.decision = decision
        state.migration = migration_for(ctx, state, decision.ranked)
        first = 0
        if self.hedger.applies(state):
            try:
                return await self.hedger.race(state, decision.ranked)
            except Retryable as exc:  # every leg failed before a token: retry past them
                last = exc.failure
                first = 2 if record.hedge is not None and record.hedge["sent"] else 1
        for rank, index in enumerate(decision.ranked):
            if rank < first:
                continue
            if rank > 0:
                if not ctx.budget.may_retry(rank - 1, time.monotonic()):
                    if rank <= ctx.budget.max_retries:
                        ctx.metrics.retry_refused.inc()
                        record.error = "retry refused by the retry budget"
                    break
                ctx.metrics.retries.inc()
            try:
                return await self.attempt(state, rank, index)
            except Retryable as exc:
                last = exc.failure
            except Migrate as exc:
                return await self.migrator.resume(state, decision.ranked, rank, exc.failure)
        assert last is not None
        if isinstance(last, Reply):
            return last
        return error_reply(
            last.status,
            last.message,
            code=last.code,
            headers=decision_headers(record),
        )

    async def attempt(self, state: RequestState, rank: int, index: int) -> Reply:
        """One attempt to engine ``index`` of ``state.fleet``; raises ``Retryable``."""
        ctx = self.ctx
        upstream = ctx.upstream
        assert upstream is not None
        fleet, strategy, route, record = state.fleet, state.strategy, state.route, state.record
        assert fleet is not None and strategy is not None and route is not None
        loop = state.loop
        engine = fleet.engines[index]
        engine_id = int(fleet.engine_ids[index])
        attempt = Attempt(engine=engine.name, rank=rank, stage=state.stage)
        record.attempts.append(attempt)
        started = loop.time()
        policy = strategy.policy
        policy.on_routed(route, engine_id)
        tokens = route.prompt_tokens + (route.expected_output_tokens or 0)
        # A P/D decode step's prompt arrives as KV: nothing of it queues for prefill; nor
        # does the prefix the policy expects cached at its chosen engine.
        if state.stage == "decode":
            queued = 0
        elif state.decision is not None:
            queued = state.decision.queued_prefill_tokens(index, route.prompt_tokens)
        else:
            queued = route.prompt_tokens
        prefill = fleet.attempt_started(index, tokens, queued)
        tracked = strategy.admit(index, route, started, state.stage)
        ok = False
        trace = state.trace
        span = trace.attempt_started(attempt) if trace is not None else None
        try:
            headers = self.headers.to_engine(state.request, engine.api_key, record.request_id)
            if trace is not None and span is not None:
                headers = trace.engine_headers(headers, span)
            try:
                resp = await upstream.open(
                    engine, state.request.path, state.body, headers, state.deadline
                )
            except UpstreamError as exc:
                attempt.detail = exc.message
                record_outcome(ctx, fleet, index, exc.outcome, attempt)
                raise Retryable(exc) from None
            try:
                record.timings.setdefault("first_byte", loop.time() - state.t0)
                attempt.status = resp.status
                if resp.status >= 400:
                    return await self.relay.upstream_error(state, resp, index, attempt)
                if resp.content_type == "text/event-stream":
                    result = await self.relay.stream(state, resp, index, attempt, tracked, prefill)
                else:
                    try:
                        data = upstream.complete_body(resp, engine.name)  # no wait: common
                        if data is None:
                            data = await upstream.read_body(resp, engine.name, state.deadline)
                    except UpstreamError as exc:
                        attempt.detail = exc.message
                        record_outcome(ctx, fleet, index, exc.outcome, attempt)
                        raise Retryable(exc) from None
                    result = self._whole(state, resp, index, attempt, data)
                    if tracked is not None:
                        tracked.body(data)
                ok = attempt.outcome == "success"
                return result
            finally:
                resp.close()  # no-op once the body was read to its end
        finally:
            attempt.duration_s = loop.time() - started
            prefill.done()
            fleet.attempt_finished(index, tokens)
            if tracked is not None:
                strategy.release(tracked, ok, loop.time())
            if ok:
                fleet.observe(index, Ewma.E2E_S, loop.time() - state.t0)
            policy.on_complete(route, engine_id, ok)
            if trace is not None and span is not None:
                trace.attempt_finished(span, attempt)

    def _whole(
        self, state: RequestState, resp: Response, index: int, attempt: Attempt, data: bytes
    ) -> Reply:
        """The reply of an engine's whole (not streamed) successful answer."""
        fleet = state.fleet
        assert fleet is not None
        ctx = self.ctx
        record_outcome(ctx, fleet, index, Outcome.SUCCESS, attempt)
        if ctx.aggregator is not None:
            row_key = int(fleet.row_keys[state.row])
            ctx.aggregator.observe_output(row_key, completion_tokens_of(data))
        raw_head = self.headers.to_client(resp, state.record)
        return Reply(resp.status, [], data, raw_head=raw_head)
