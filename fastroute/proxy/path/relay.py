"""Relaying an engine's answer to the client: SSE streams chunk by chunk, and engine
errors in OpenAI shape with the engine's address scrubbed.

A stream is committed to the client only once its first chunk arrived (a failure
before it is retryable); a stream that breaks after it is continued on another engine
when it can be (:mod:`fastroute.proxy.path.migration`: the relay keeps what it wrote and
raises :class:`~fastroute.proxy.path.migration.Migrate`), else it ends with one SSE
error event and a clean end of the body. A stream whose engine starts draining is handed
off the same way once the engine's hand-off time passed
(:mod:`fastroute.proxy.path.drain`; checked per chunk: one list index, one compare).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from fastroute.guards.outlier import Outcome
from fastroute.proxy.http.http1 import Response
from fastroute.proxy.http.openai_errors import (
    ErrorCode,
    error_reply,
    parse_error_body,
    sse_error_event,
)
from fastroute.proxy.http.reply import Reply, Splice
from fastroute.proxy.http.upstream import UpstreamError
from fastroute.proxy.path.decisions import Attempt
from fastroute.proxy.path.engine_load import AttemptLoad
from fastroute.proxy.path.headers import HeaderRelay, decision_headers
from fastroute.proxy.path.migration import DrainHandoff, Migrate, Migration, migration_reason
from fastroute.proxy.path.outcomes import Retryable, record_outcome
from fastroute.proxy.path.request_state import RequestState
from fastroute.proxy.path.sse import StreamMeter
from fastroute.tables.stats import Ewma

if TYPE_CHECKING:
    from fastroute.proxy.path.fleet import Fleet, QueuedPrefill
    from fastroute.proxy.path.handler import ProxyContext
    from fastroute.proxy.path.migration import Migrator

__all__ = ["Relay", "scrub_error"]

_SSE_END = b"\n\n"
#: A choice's ``finish_reason`` with a value (compact and spaced JSON).
_FINISH = b'"finish_reason":"'
_FINISH_SPACED = b'"finish_reason": "'


class _StreamTally:
    """A relayed SSE body: its reads, the last bytes written and what its events carried
    (:class:`~fastroute.proxy.path.sse.StreamMeter`).

    ``on_first_token(now)`` runs at the first token event; ``tracked``
    (``marginal-cost`` classes) is told of every token event; ``keep`` (a stream that
    may be migrated) keeps what is written and rewrites a continuation's events. With
    ``splice`` set, :meth:`relay` is the engine connection's callback
    (:meth:`Response.relay`). With ``handoff_at`` set (the fleet's
    :attr:`~fastroute.proxy.path.drain.DrainMarks.handoff_at`, a stream that may be
    migrated), :meth:`draining` compares ``handoff_at[index]`` per chunk and calls
    ``on_drain`` once it passed (True: handed off, the engine's connection is closed).
    """

    __slots__ = ("n_chunks", "last", "meter", "tracked", "on_first_token", "splice", "keep",
                 "handoff_at", "index", "on_drain", "handed_off", "prefill")  # fmt: skip

    def __init__(
        self,
        meter: StreamMeter,
        tracked: AttemptLoad | None,
        on_first_token: Callable[[float], None],
        keep: Migration | None = None,
    ) -> None:
        self.n_chunks = 0
        self.last = b""  # the last bytes written; its tail is only looked at on failure
        self.meter = meter
        self.tracked = tracked
        self.on_first_token = on_first_token
        self.splice: Splice | None = None
        self.keep = keep
        self.handoff_at: list[float] | None = None
        self.index = 0
        self.on_drain: Callable[[], bool] | None = None
        self.handed_off = False
        #: The attempt's queued prompt tokens, released at the first token event (a
        #: hedged race's loser too: its engine prefilled it either way).
        self.prefill: QueuedPrefill | None = None

    def draining(self, now: float, last: bool) -> bool:
        """Hand the stream off if its engine's hand-off time passed (checked once per
        chunk, acted on once); True when it was handed off."""
        handoff_at = self.handoff_at
        if handoff_at is None or now < handoff_at[self.index] or last:
            return False
        self.handoff_at = None  # decided once: handed off, or it stays
        keep = self.keep
        if keep is None or keep.cut or not keep.intact or self.on_drain is None:
            return False
        self.handed_off = self.on_drain()
        return self.handed_off

    def add(self, chunk: bytes, now: float, last: bool = False) -> bytes:
        """Measure a read at ``now``; the bytes to write for it."""
        self.n_chunks += 1
        meter = self.meter
        before = meter.token_events
        data = meter.feed(chunk, now, last)
        keep = self.keep
        if keep is not None and data:
            data = keep.relayed(data, meter.error is not None)
        if data:
            self.last = data
        if meter.token_events != before:
            if before == 0:
                if self.prefill is not None:
                    self.prefill.done()
                self.on_first_token(now)
            if self.tracked is not None:
                self.tracked.tokens(meter.token_events - before, now)
        return data

    def finish(self, now: float) -> bytes:
        """The bytes still held at the body's end (a partial last event), measured."""
        self.n_chunks -= 1
        return self.add(b"", now, last=True)

    def relay(self, chunk: bytes, now: float, last: bool) -> bool:
        """Write a read to the client (``last``: the engine's body ended with it, so end
        the client's too) and measure it; False when the client is full."""
        assert self.splice is not None
        data = self.add(chunk, now, last)
        more = True
        if data:  # an empty write would end the chunked body; the relay ends it
            keep = self.keep
            if keep is not None and keep.cut:
                last = False  # an error was held back: a continuation may follow
            more = self.splice.write_now(data, last)
        handoff_at = self.handoff_at
        if handoff_at is not None and now >= handoff_at[self.index]:  # the per-chunk check
            self.draining(now, last)
        return more


def _no_first_token(now: float) -> None:
    """A continuation's first token: the request's TTFT was its first segment's."""


def scrub_error(
    fleet: Fleet, data: bytes, engine: str, status: int
) -> tuple[str, str | None, str | None, ErrorCode | None]:
    """Message, type, param, code of an engine's error body (wrapped or flat,
    :func:`~fastroute.proxy.http.openai_errors.parse_error_body`), without its address.

    A body that is not JSON, or has no message, gets one naming the engine and status.
    """
    message = f"Engine {engine} rejected the request (HTTP {status})."
    fields = parse_error_body(data)
    etype = param = code = None
    if fields is not None:
        message = fields.message or message
        etype, param, code = fields.type, fields.param, fields.code
    e = fleet.engines[fleet.names.index(engine)]
    netloc = e.url.split("://", 1)[-1]
    for secret in (e.url, netloc):
        message = message.replace(secret, f"<{engine}>")
    return message, etype, param, code


class Relay:
    """Relays engine answers of one :class:`~fastroute.proxy.path.handler.ProxyContext`.

    Parameters
    ----------
    ctx : ProxyContext
    headers : HeaderRelay
        The response-header verdicts of the handler.
    """

    def __init__(self, ctx: ProxyContext, headers: HeaderRelay) -> None:
        self.ctx = ctx
        self.headers = headers
        self.retry_on_status = ctx.config.retry.retry_on_status
        self.timeouts = ctx.config.timeouts
        #: Plans drain hand-offs (the forwarder's); None: streams never hand off.
        self.migrator: Migrator | None = None

    async def upstream_error(
        self, state: RequestState, resp: Response, index: int, attempt: Attempt
    ) -> Reply:
        """An engine answered >= 400 before any byte reached the client."""
        assert self.ctx.upstream is not None
        fleet, record, engine = state.fleet, state.record, attempt.engine
        assert fleet is not None
        status = resp.status
        try:
            data = await self.ctx.upstream.read_body(resp, engine, state.deadline)
        except UpstreamError:
            data = b""
        if status >= 500:
            outcome = Outcome.HTTP_5XX
        elif status == 429:
            outcome = Outcome.RATE_LIMITED
        else:
            outcome = Outcome.CLIENT_ERROR
        record_outcome(self.ctx, fleet, index, outcome, attempt)
        attempt.detail = f"engine answered {status}"
        if status >= 500:
            err = UpstreamError(Outcome.HTTP_5XX, f"engine {engine} answered {status}")
            if status in self.retry_on_status:
                raise Retryable(err)
            return error_reply(502, err.message, code=err.code, headers=decision_headers(record))
        message, etype, param, code = scrub_error(fleet, data, engine, status)
        headers = decision_headers(record)
        if "Retry-After" in resp.headers:
            headers["Retry-After"] = resp.headers["Retry-After"]
        response = error_reply(status, message, code=code, param=param, type=etype, headers=headers)
        if status in self.retry_on_status:
            raise Retryable(response)
        return response

    async def stream(
        self,
        state: RequestState,
        resp: Response,
        index: int,
        attempt: Attempt,
        tracked: AttemptLoad | None,
        prefill: QueuedPrefill | None = None,
    ) -> Reply:
        """Relay an SSE body chunk by chunk; the first chunk is read before committing.

        TTFT is taken at the first event that carries a token, TBOT and the output
        length from :class:`~fastroute.proxy.path.sse.StreamMeter`; ``tracked``
        (``marginal-cost`` classes) is told of the first token and every token event;
        ``prefill`` (the attempt's queued prompt tokens) is released at the first token.
        """
        ctx = self.ctx
        upstream = ctx.upstream
        assert upstream is not None
        fleet, record, sink, loop = state.fleet, state.record, state.sink, state.loop
        assert fleet is not None
        try:
            chunk = await upstream.read_chunk(
                resp, attempt.engine, self.timeouts.first_byte_timeout_s, state.deadline
            )
            if not chunk:
                raise UpstreamError(
                    Outcome.CONNECT_ERROR, f"engine {attempt.engine} sent an empty stream"
                )
        except UpstreamError as exc:
            attempt.detail = exc.message
            record_outcome(ctx, fleet, index, exc.outcome, attempt)
            raise Retryable(exc) from None
        headers = [("Cache-Control", "no-cache")]
        migration = state.migration
        on_first_token = partial(self._first_token, state, index, attempt, tracked)
        if migration is not None:
            migration.begin_segment(attempt)
            if migration.rewriter is not None:  # a continuation: the client's stream is open
                on_first_token = tracked.first_token if tracked is not None else _no_first_token
        if migration is None or migration.rewriter is None:
            await sink.start(resp.status, headers, self.headers.to_client(resp, record))
        first_at = loop.time()
        meter = state.meter_type(state.strip_usage)
        tally = _StreamTally(meter, tracked, on_first_token, migration)
        tally.prefill = prefill
        if (
            migration is not None
            and migration.ranked is not None
            and fleet.drain.enabled
            and self.migrator is not None
        ):
            tally.handoff_at, tally.index = fleet.drain.handoff_at, index
            tally.on_drain = partial(self._hand_off, state, resp, attempt, tally)
        broken: UpstreamError | None = None
        try:
            await sink.write(tally.add(chunk, first_at))
            splice = sink.splice()
            failure: UpstreamError | None = None
            if splice is not None:
                # The engine's chunks go to the client from the connection's callback:
                # this coroutine only wakes at the end (or on a failure or timeout).
                tally.splice = splice
                splice.on_writable(resp.resume_reading)
                resp.relay(tally.relay)
                try:
                    await upstream.wait_end(resp, attempt.engine, state.deadline)
                except UpstreamError as exc:
                    failure = exc
                finally:
                    splice.on_writable(None)
            else:
                while True:
                    try:
                        chunk = await upstream.read_chunk(
                            resp, attempt.engine, self.timeouts.idle_timeout_s, state.deadline
                        )
                    except UpstreamError as exc:
                        failure = exc
                        break
                    if not chunk:
                        break
                    now = loop.time()
                    await sink.write(tally.add(chunk, now))
                    handoff_at = tally.handoff_at
                    if handoff_at is not None and now >= handoff_at[index]:
                        if tally.draining(now, False):
                            break
            broken = await self._end(state, index, attempt, tally, failure)
        except ConnectionResetError:  # aiohttp's ClientConnectionResetError is one
            attempt.outcome = "client_disconnected"
            record.error = "client disconnected mid-stream"
        if tracked is not None:
            tracked.usage = meter.usage
        if state.trace is not None and meter.usage is not None:
            state.trace.prompt_tokens = meter.usage.prompt_tokens
        self._account(state, index, attempt, tally, first_at)
        if broken is not None:
            assert migration is not None
            migration.ended.append(migration_reason(broken))
            raise Migrate(broken)
        return Reply(resp.status, headers, streamed=True)

    def _hand_off(
        self, state: RequestState, resp: Response, attempt: Attempt, tally: _StreamTally
    ) -> bool:
        """The stream's engine is draining: close its connection (the engine aborts the
        request) if the stream can be continued elsewhere (True), else it stays."""
        migration = state.migration
        assert migration is not None and self.migrator is not None
        if _FINISH in tally.last or _FINISH_SPACED in tally.last:
            return False  # the output ended; only its usage and [DONE] are still to come
        attempt.output_tokens = tally.meter.tokens  # the continuation starts after them
        why = self.migrator.handoff(state, attempt.rank)
        if why is not None:
            migration.stays = why
            state.record.not_migrated = f"stays on draining engine {attempt.engine}: {why}"
            return False
        resp.close()  # wakes a relay's wait_end with ConnectionDropped
        return True

    async def _end(
        self,
        state: RequestState,
        index: int,
        attempt: Attempt,
        tally: _StreamTally,
        failure: UpstreamError | None,
    ) -> UpstreamError | None:
        """End a relayed stream: record its outcome; a broken stream that may be
        migrated stays open (its failure is returned), any other ends here."""
        sink, keep = state.sink, tally.keep
        if tally.handed_off:  # planned: not a failure of the engine, nothing recorded
            attempt.outcome = "drained"
            attempt.detail = f"handed off after {tally.n_chunks} chunks: engine draining"
            return DrainHandoff(attempt.engine)  # a partial last event is dropped
        if keep is not None and keep.intact and (keep.cut or failure is not None):
            self._stream_outcome(state, index, attempt, tally, failure)
            if failure is None:  # the in-stream error event was held back
                failure = UpstreamError(
                    Outcome.HTTP_5XX, f"engine {attempt.engine} sent an in-stream error"
                )
            return failure  # a partial last event (cut off by the failure) is dropped
        await sink.write(tally.finish(state.loop.time()))
        self._stream_outcome(state, index, attempt, tally, failure)
        if failure is not None:
            sep = b"" if tally.last.endswith(_SSE_END) else _SSE_END
            await sink.write(sep + sse_error_event(failure.message, code=failure.code))
        migration = state.migration
        if (failure is not None or tally.meter.error is not None) and (
            migration is None or migration.count == 0  # a continuation's end is the migrator's
        ):
            self.ctx.metrics.broken_streams.labels("not_migrated").inc()
        await sink.end()
        return None

    def _first_token(
        self,
        state: RequestState,
        index: int,
        attempt: Attempt,
        tracked: AttemptLoad | None,
        now: float,
    ) -> None:
        """The stream's first token event arrived at ``now``: TTFT into the record,
        metrics and fleet; the tracked attempt is running from here."""
        fleet = state.fleet
        assert fleet is not None and state.cls is not None
        hedge = state.hedge
        if hedge is not None and not hedge.first_token(now):
            return  # a hedged race's loser (being cancelled): its token is not the client's
        if tracked is not None:
            tracked.first_token(now)
        ttft_s = now - state.t0
        state.record.timings["first_token"] = ttft_s
        self.ctx.metrics.ttft_of(state.cls.name, attempt.engine).observe(ttft_s)
        fleet.observe(index, Ewma.TTFT_S, ttft_s)

    def _stream_outcome(
        self,
        state: RequestState,
        index: int,
        attempt: Attempt,
        tally: _StreamTally,
        failure: UpstreamError | None,
    ) -> None:
        """Record how a relayed stream ended: a broken stream, an in-stream error event
        (an engine fault, though the status was 200) or a success."""
        fleet = state.fleet
        assert fleet is not None
        error = tally.meter.error
        if failure is not None:
            attempt.detail = f"stream broke after {tally.n_chunks} chunks: {failure.message}"
            outcome = failure.outcome
        elif error is not None:
            text = error[:200].decode(errors="replace")
            attempt.detail = f"engine sent an in-stream error: {text}"
            outcome = Outcome.HTTP_5XX
        else:
            record_outcome(self.ctx, fleet, index, Outcome.SUCCESS, attempt)
            return
        record_outcome(self.ctx, fleet, index, outcome, attempt)
        state.record.error = attempt.detail

    def _account(
        self,
        state: RequestState,
        index: int,
        attempt: Attempt,
        tally: _StreamTally,
        first_at: float,
    ) -> None:
        """TBOT and output length of a relayed stream into the record, metrics, stats."""
        ctx, fleet, meter = self.ctx, state.fleet, tally.meter
        assert fleet is not None and state.cls is not None
        n_tokens = attempt.output_tokens = meter.tokens
        if meter.token_events == 0:  # no token at all: TTFT is the first byte's
            state.record.timings.setdefault("first_token", first_at - state.t0)
        tbot_s = meter.tbot_s
        if tbot_s is not None:
            state.record.timings["tbot_s"] = tbot_s
            ctx.metrics.tbot_of(state.cls.name, attempt.engine).observe(tbot_s)
            fleet.observe(index, Ewma.TBOT_S, tbot_s)
        if ctx.aggregator is not None:
            engine_id = int(fleet.engine_ids[index])
            ttft_s = state.record.timings["first_token"]
            ctx.aggregator.observe_latency(engine_id, ttft_s, tbot_s)
            ctx.aggregator.observe_output(int(fleet.row_keys[state.row]), n_tokens)
