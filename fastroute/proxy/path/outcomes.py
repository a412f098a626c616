"""How an attempt ended: recorded once (attempt, metrics, outlier detector, report
counters), and :class:`Retryable` for a failure the next ranked engine may retry."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastroute.guards.outlier import Outcome
from fastroute.proxy.http.reply import Reply
from fastroute.proxy.http.upstream import UpstreamError
from fastroute.proxy.path.decisions import Attempt

if TYPE_CHECKING:
    from fastroute.proxy.path.fleet import Fleet
    from fastroute.proxy.path.handler import ProxyContext

__all__ = ["Retryable", "record_outcome"]

#: ``Attempt.outcome`` of each outcome (``Enum.name`` is a slow descriptor).
_OUTCOME_TEXT = {o: o.name.lower() for o in Outcome}
_FAILURE_OUTCOMES = frozenset({Outcome.HTTP_5XX, Outcome.CONNECT_ERROR, Outcome.TIMEOUT})


class Retryable(Exception):
    """An attempt failed before any byte reached the client; the next candidate may try."""

    def __init__(self, failure: UpstreamError | Reply) -> None:
        super().__init__(str(failure))
        self.failure = failure


def record_outcome(
    ctx: ProxyContext, fleet: Fleet, index: int, outcome: Outcome, attempt: Attempt
) -> None:
    """Record how an attempt to engine ``index`` of ``fleet`` ended."""
    attempt.outcome = _OUTCOME_TEXT[outcome]
    if outcome in _FAILURE_OUTCOMES:
        ctx.metrics.upstream_failures.labels(attempt.engine, attempt.outcome).inc()
    if fleet.outlier.record(index, outcome, fleet.clock()):
        ctx.metrics.ejections.labels(attempt.engine).inc()
    if ctx.aggregator is not None:
        ok = outcome is Outcome.SUCCESS
        ctx.aggregator.observe_attempt(int(fleet.engine_ids[index]), ok, attempt.outcome)
