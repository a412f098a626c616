"""Mid-stream migration: a chat or completions stream whose engine fails after tokens
reached the client continues on the next ranked engine, in the same client stream.

The relay keeps the bytes it wrote to the client (a list of the chunks, bounded by
``retry.max_migration_text_bytes``; nothing is decoded on the happy path) and holds an
engine's in-stream error event back. When the stream breaks (connection reset, idle
timeout, in-stream error event) it raises :class:`Migrate`; :class:`Migrator` then
re-sends the request with the text so far to the next ranked engine that can continue
it (:mod:`fastroute.proxy.path.continuation`), within ``retry.max_migrations`` and the
retry budget (a migration is a retry), and the relay writes the continuation's events
into the same client stream (:class:`~fastroute.proxy.path.continuation.SegmentRewriter`).
When no migration can be made the stream ends as it did before migration existed: one
SSE error event and a clean end.

A stream on an engine that starts draining (:mod:`fastroute.proxy.path.drain`) is
handed off the same way: the relay asks :meth:`Migrator.handoff` whether it can be
continued (the same checks, without the retry budget: a hand-off is planned work, not a
failure), closes the engine's connection (the engine aborts the request) and raises
:class:`Migrate` with a :class:`DrainHandoff`; a stream that cannot be continued stays
and finishes where it is. See docs/failure-handling.md, "Mid-stream migration".
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from fastroute.guards.outlier import Outcome
from fastroute.proxy.http.openai_errors import sse_error_event
from fastroute.proxy.http.reply import Reply
from fastroute.proxy.http.upstream import UpstreamError
from fastroute.proxy.path.continuation import (
    NOT_CONTINUABLE_KINDS,
    SegmentRewriter,
    continuation_body,
    relayed_text,
)
from fastroute.proxy.path.decisions import Attempt
from fastroute.proxy.path.outcomes import Retryable
from fastroute.proxy.path.request_state import RequestState

if TYPE_CHECKING:
    from fastroute.proxy.path.handler import ProxyContext

__all__ = ["DrainHandoff", "Migrate", "Migration", "Migrator", "migration_for", "migration_reason"]

#: The endpoints whose streams can be migrated.
MIGRATABLE_KINDS = frozenset({"chat", "completions"})
_ERROR_START = b'data: {"error"'
_SSE_END = b"\n\n"
#: Chunks after an in-stream error event that are held back (its ``[DONE]``; the rest
#: of a stream that goes on after an error is dropped).
_MAX_HELD_BACK_CHUNKS = 4
_STREAM_HEADERS = [("Cache-Control", "no-cache")]


class Migrate(Exception):
    """A relayed stream broke after bytes reached the client and may be continued (or was
    handed off from a draining engine: ``failure`` is a :class:`DrainHandoff`)."""

    def __init__(self, failure: UpstreamError) -> None:
        super().__init__(failure.message)
        self.failure = failure


class DrainHandoff(UpstreamError):
    """Why a stream left its engine: the engine is draining (no failure of the engine)."""

    def __init__(self, engine: str) -> None:
        super().__init__(Outcome.SUCCESS, f"engine {engine} is draining: stream handed off")


#: ``fastroute_proxy_migrations_total`` reasons (and the decision record's segment
#: ``ended``) of the outcomes a stream breaks with.
_REASONS = {Outcome.TIMEOUT: "timeout", Outcome.HTTP_5XX: "error"}


def migration_reason(failure: UpstreamError) -> str:
    """Why a segment ended: ``drain``, ``timeout`` (idle timeout), ``error`` (an in-stream
    error event, a refused continuation) or ``connection`` (reset, dropped)."""
    if isinstance(failure, DrainHandoff):
        return "drain"
    return _REASONS.get(failure.outcome, "connection")


class Migration:
    """The migration state of one streamed request.

    Parameters
    ----------
    body : bytes
        The request as first forwarded (continuations are built from it).
    limit_bytes : int
        Most bytes relayed that are kept (``retry.max_migration_text_bytes``).

    Attributes
    ----------
    kept : list of bytes or None
        What was written to the client, chunk by chunk; None once over ``limit_bytes``
        (then the stream is not migrated).
    count : int
        Migrations made.
    rewriter : SegmentRewriter or None
        Set while a continuation is relayed.
    cut : bool
        The segment under way sent an in-stream error: it and what follows were held back.
    held_back : list of bytes
        What was held back of the segment under way (relayed as the engine sent it when
        the stream is not migrated).
    segments : list of Attempt
        The attempts whose output went into the client's stream, in order.
    ended : list of str
        Why each segment but the one under way ended (:func:`migration_reason`).
    ranked : sequence of int or None
        The decision's ranking (engine indices), for a drain hand-off's candidates;
        None (a hedged leg): never handed off.
    handoff : tuple of (bytes, SegmentRewriter) or None
        The continuation a drain hand-off prepared (:meth:`Migrator.handoff`).
    stays : str or None
        Why the stream stays on its draining engine (it cannot be continued).
    """

    __slots__ = ("body", "limit_bytes", "kept", "kept_bytes", "count", "rewriter", "cut",
                 "held_back", "segments", "ended", "ranked", "handoff", "stays")  # fmt: skip

    def __init__(self, body: bytes, limit_bytes: int, ranked: Sequence[int] | None = None) -> None:
        self.body = body
        self.limit_bytes = limit_bytes
        self.kept: list[bytes] | None = []
        self.kept_bytes = 0
        self.count = 0
        self.rewriter: SegmentRewriter | None = None
        self.cut = False
        self.held_back: list[bytes] = []
        self.segments: list[Attempt] = []
        self.ended: list[str] = []
        self.ranked = ranked
        self.handoff: tuple[bytes, SegmentRewriter] | None = None
        self.stays: str | None = None

    def relayed(self, data: bytes, errored: bool) -> bytes:
        """The bytes to write to the client for ``data`` (whole events the meter passed;
        ``errored``: the segment's in-stream error event is in it or came before)."""
        if self.cut:
            if len(self.held_back) < _MAX_HELD_BACK_CHUNKS:
                self.held_back.append(data)
            return b""
        rewriter = self.rewriter
        if rewriter is not None:
            data = rewriter.rewrite(data)
        kept = self.kept
        if kept is None:
            return data
        if self.kept_bytes + len(data) > self.limit_bytes:
            self.kept = None  # over the bound: relayed as if migration did not exist
            return data
        if errored:  # held back: a continuation may follow instead
            self.cut = True
            i = max(data.find(_ERROR_START), 0)
            self.held_back.append(data[i:])
            data = data[:i]
        kept.append(data)
        self.kept_bytes += len(data)
        return data

    @property
    def intact(self) -> bool:
        """Everything relayed is kept: the stream may be continued."""
        return self.kept is not None

    def begin_segment(self, attempt: Attempt) -> None:
        """A segment's attempt is relaying (a continuation when :attr:`rewriter` is set)."""
        self.segments.append(attempt)
        self.cut = False
        self.held_back = []


def migration_for(
    ctx: ProxyContext, state: RequestState, ranked: Sequence[int] | None = None
) -> Migration | None:
    """A :class:`Migration` for a request about to be forwarded (``ranked``: the
    decision's ranking, for drain hand-offs), or None when its stream is never migrated
    (not a chat/completions stream, a P/D stage, its class has ``migrate = false``, or
    ``retry.max_migrations`` is 0)."""
    retry = ctx.config.retry
    parsed, cls = state.parsed, state.cls
    if (
        retry.max_migrations == 0
        or state.stage is not None
        or state.kind not in MIGRATABLE_KINDS
        or parsed is None
        or not parsed.stream
        or cls is None
        or not cls.migrate
        or state.body is None
    ):
        return None
    return Migration(state.body, retry.max_migration_text_bytes, ranked)


AttemptFn = Callable[[RequestState, int, int], Awaitable[Reply]]


class Migrator:
    """Continues broken streams of one :class:`~fastroute.proxy.path.handler.ProxyContext`.

    Parameters
    ----------
    ctx : ProxyContext
    attempt : callable
        ``attempt(state, rank, index)``: one attempt to engine ``index`` of ``state.fleet``
        (the forwarder's), raising ``Retryable`` or :class:`Migrate`.
    """

    def __init__(self, ctx: ProxyContext, attempt: AttemptFn) -> None:
        self.ctx = ctx
        self.attempt = attempt

    async def resume(
        self, state: RequestState, ranked: Sequence[int], rank: int, failure: UpstreamError
    ) -> Reply:
        """Continue the stream of ``state`` whose attempt at ``ranked[rank]`` broke with
        ``failure`` (or was handed off, a :class:`DrainHandoff`) on the engines ranked
        after it; else end it with an SSE error event."""
        migration = state.migration
        assert migration is not None and state.fleet is not None
        engines = state.fleet.engines
        later = self._candidates(state, ranked, rank)
        metrics = self.ctx.metrics
        reason = None
        while True:
            body, rewriter, reason = self._next(state, migration, bool(later))
            if body is None or rewriter is None:
                break
            migration.count += 1
            metrics.migrations.labels(migration_reason(failure)).inc()
            if not isinstance(failure, DrainHandoff):
                metrics.retries.inc()  # a failure's migration is a retry
            next_rank, index = later.pop(0)
            state.body = body
            migration.rewriter = rewriter
            try:
                reply = await self._continue_on(state, next_rank, index)
            except Retryable as exc:
                if isinstance(exc.failure, UpstreamError):
                    failure = exc.failure
                continue
            except Migrate as exc:
                failure = exc.failure
                continue
            if not reply.streamed:  # the engine refused the continuation (an error reply)
                engine = engines[index].name
                message = f"engine {engine} refused the continuation (HTTP {reply.status})"
                failure = UpstreamError(Outcome.HTTP_5XX, message)
                continue
            state.record.error = None
            self._segments(state)
            finished = migration.segments[-1].outcome == "success"
            if not isinstance(failure, DrainHandoff) or migration.count > 1:
                self.ctx.metrics.broken_streams.labels("migrated" if finished else "failed").inc()
            return reply
        state.record.not_migrated = reason
        self._segments(state)
        outcome = "failed" if migration.count else "not_migrated"
        self.ctx.metrics.broken_streams.labels(outcome).inc()
        await self._end(state, failure)
        return Reply(200, _STREAM_HEADERS, streamed=True)

    def handoff(self, state: RequestState, rank: int) -> str | None:
        """A stream at rank ``rank`` on a draining engine: prepare its continuation on the
        next ranked engine (:attr:`Migration.handoff`); None when it is ready, else why
        the stream stays. No retry-budget withdrawal: planned work, not a failure."""
        migration = state.migration
        assert migration is not None
        if migration.ranked is None:
            return "a hedged stream keeps its engine"
        later = self._candidates(state, migration.ranked, rank)
        body, rewriter, reason = self._plan(state, migration, bool(later))
        if body is None or rewriter is None:
            return reason
        migration.handoff = body, rewriter
        return None

    def _candidates(
        self, state: RequestState, ranked: Sequence[int], rank: int
    ) -> list[tuple[int, int]]:
        """(rank, index) of the engines ranked after ``rank`` that can continue a stream:
        not of a kind in ``NOT_CONTINUABLE_KINDS``, not draining."""
        fleet = state.fleet
        assert fleet is not None
        engines, drain = fleet.engines, fleet.drain
        return [
            (r, i)
            for r, i in enumerate(ranked)
            if r > rank and engines[i].kind not in NOT_CONTINUABLE_KINDS and not drain.draining(i)
        ]

    async def _continue_on(self, state: RequestState, rank: int, index: int) -> Reply:
        """The continuation's attempt; traced, inside its ``fastroute.migration`` span."""
        trace = state.trace
        if trace is None:
            return await self.attempt(state, rank, index)
        migration = state.migration
        assert migration is not None and state.fleet is not None
        tokens_sent = sum(a.output_tokens or 0 for a in migration.segments)
        engine = state.fleet.engines[index].name
        segment = trace.segment_started(migration.count, engine, tokens_sent)
        try:
            return await self.attempt(state, rank, index)
        finally:
            attempts = state.record.attempts
            trace.segment_finished(segment, attempts[-1].outcome if attempts else "none")

    def _next(
        self, state: RequestState, migration: Migration, candidate: bool
    ) -> tuple[bytes | None, SegmentRewriter | None, str]:
        """The next continuation's body and rewriter (a drain hand-off's prepared one
        first), or why there is none."""
        prepared = migration.handoff
        if prepared is not None:
            migration.handoff = None
            if candidate:  # (its engine may have started draining since)
                return prepared[0], prepared[1], ""
        body, rewriter, reason = self._plan(state, migration, candidate)
        if body is None:
            return None, None, reason
        if not self.ctx.budget.try_withdraw(time.monotonic()):
            self.ctx.metrics.retry_refused.inc()
            return None, None, "refused by the retry budget"
        return body, rewriter, ""

    def _plan(
        self, state: RequestState, migration: Migration, candidate: bool
    ) -> tuple[bytes | None, SegmentRewriter | None, str]:
        """A continuation's body and rewriter within the bounds (not the budget), or why
        there is none."""
        retry = self.ctx.config.retry
        if not migration.intact:
            limit = retry.max_migration_text_bytes
            return None, None, f"over retry.max_migration_text_bytes={limit}"
        if migration.count >= retry.max_migrations:
            return None, None, f"retry.max_migrations={retry.max_migrations} reached"
        if not candidate:
            return None, None, "no other ranked engine can continue it"
        assert migration.kept is not None
        chat = state.kind == "chat"
        relayed = relayed_text(migration.kept, chat)
        if relayed.blocker is not None:
            return None, None, relayed.blocker
        if relayed.response_id is None:
            return None, None, "no event with an id was relayed"
        tokens_sent = sum(a.output_tokens or 0 for a in migration.segments)
        body, refusal = continuation_body(migration.body, chat, relayed.text, tokens_sent)
        if body is None:
            return None, None, refusal or "not continuable"
        rewriter = SegmentRewriter(relayed.response_id, relayed.created, tokens_sent)
        return body, rewriter, ""

    def _segments(self, state: RequestState) -> None:
        """Every segment of the stream into the decision record."""
        migration = state.migration
        assert migration is not None
        ended = migration.ended
        state.record.segments = [
            _segment(a, ended[n] if n < len(ended) else None)
            for n, a in enumerate(migration.segments)
        ]

    async def _end(self, state: RequestState, failure: UpstreamError) -> None:
        """End the client's stream with one SSE error event: the engine's own in-stream
        error (and what followed it) when it sent one, else the proxy's."""
        migration = state.migration
        assert migration is not None
        last = migration.kept[-1] if migration.kept else b""
        sep = b"" if not last or last.endswith(_SSE_END) else _SSE_END
        error = b"".join(migration.held_back)
        if not error:
            error = sse_error_event(failure.message, code=failure.code)
        try:
            await state.sink.write(sep + error)
            await state.sink.end()
        except ConnectionResetError:
            state.record.error = "client disconnected mid-stream"


def _segment(attempt: Attempt, ended: str | None) -> dict[str, Any]:
    """One segment of a migrated stream, as the decision record shows it (``ended``: why
    it ended, :func:`migration_reason`; the last segment's is its outcome)."""
    return {
        "engine": attempt.engine,
        "tokens": attempt.output_tokens or 0,
        "outcome": attempt.outcome,
        "ended": ended or attempt.outcome,
    }
