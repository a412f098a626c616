"""Relaying an engine's answer to the client: SSE streams chunk by chunk, and engine
errors in OpenAI shape with the engine's address scrubbed.

A stream is committed to the client only once its first chunk arrived (a failure
before it is retryable); a stream that breaks after it ends with one SSE error event
and a clean end of the body.
"""

from __future__ import annotations

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
from fastroute.proxy.path.outcomes import Retryable, record_outcome
from fastroute.proxy.path.request_state import RequestState
from fastroute.proxy.path.sse import DATA_PREFIX, USAGE_MARK, output_events
from fastroute.tables.stats import Ewma

if TYPE_CHECKING:
    from fastroute.proxy.path.fleet import Fleet
    from fastroute.proxy.path.handler import ProxyContext

__all__ = ["Relay", "scrub_error"]

_SSE_END = b"\n\n"


class _StreamTally:
    """What a relayed SSE body carried: chunks, ``data:`` events, usage events, the first
    and last chunk and when the last arrived (for TBOT and output lengths).

    ``tracked`` (``marginal-cost`` classes) is told of every chunk. With ``splice`` set,
    :meth:`relay` is the engine connection's callback (:meth:`Response.relay`).
    """

    __slots__ = ("n_chunks", "n_events", "n_usage", "first", "last", "last_at", "tracked", "splice")

    def __init__(self, first: bytes, tracked: AttemptLoad | None) -> None:
        self.n_chunks = self.n_events = self.n_usage = 0
        self.first = first
        self.last = b""  # the last chunk written; its tail is only looked at on failure
        self.last_at = 0.0
        self.tracked = tracked
        self.splice: Splice | None = None

    def add(self, chunk: bytes, now: float) -> None:
        """Count a chunk written to the client at ``now``."""
        self.n_chunks += 1
        self.n_events += chunk.count(DATA_PREFIX)
        self.n_usage += chunk.count(USAGE_MARK)
        self.last = chunk
        self.last_at = now
        if self.tracked is not None:
            self.tracked.chunk(chunk, now)

    def relay(self, chunk: bytes, now: float, last: bool) -> bool:
        """Write a chunk to the client (``last``: the engine's body ended with it, so
        end the client's too) and count it; False when the client is full."""
        assert self.splice is not None
        writable = self.splice.write_now(chunk, last)
        self.add(chunk, now)
        return writable


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
    ) -> Reply:
        """Relay an SSE body chunk by chunk; the first chunk is read before committing.

        ``tracked`` (``marginal-cost`` classes): told of the first chunk and every chunk.
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
        await sink.start(resp.status, headers, self.headers.to_client(resp, record))
        first_at = loop.time()
        if tracked is not None:
            tracked.first_token(first_at)
        ttft_s = first_at - state.t0
        record.timings["first_token"] = ttft_s
        assert state.cls is not None
        ctx.metrics.ttft_of(state.cls.name, attempt.engine).observe(ttft_s)
        fleet.observe(index, Ewma.TTFT_S, ttft_s)
        tally = _StreamTally(chunk, tracked)
        try:
            await sink.write(chunk)
            tally.add(chunk, first_at)
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
                    await sink.write(chunk)
                    tally.add(chunk, loop.time())
            if failure is not None:
                attempt.detail = f"stream broke after {tally.n_chunks} chunks: {failure.message}"
                record_outcome(ctx, fleet, index, failure.outcome, attempt)
                record.error = attempt.detail
                sep = b"" if tally.last.endswith(_SSE_END) else _SSE_END
                await sink.write(sep + sse_error_event(failure.message, code=failure.code))
            else:
                record_outcome(ctx, fleet, index, Outcome.SUCCESS, attempt)
            await sink.end()
        except ConnectionResetError:  # aiohttp's ClientConnectionResetError is one
            attempt.outcome = "client_disconnected"
            record.error = "client disconnected mid-stream"
        self._account(state, index, attempt, tally, first_at)
        return Reply(resp.status, headers, streamed=True)

    def _account(
        self,
        state: RequestState,
        index: int,
        attempt: Attempt,
        tally: _StreamTally,
        first_at: float,
    ) -> None:
        """TBOT and output length of a relayed stream into the record, metrics, stats."""
        ctx, fleet = self.ctx, state.fleet
        assert fleet is not None and state.cls is not None
        # TBOT over token events: the role event comes with the first token and [DONE]
        # with the last, so the span first..last chunk covers n_tokens - 1 gaps
        n_tokens = output_events(tally.n_events, tally.n_usage, tally.first, tally.last)
        tbot_s: float | None = None
        if n_tokens > 1:
            tbot_s = (tally.last_at - first_at) / (n_tokens - 1)
            state.record.timings["tbot_s"] = tbot_s
            ctx.metrics.tbot_of(state.cls.name, attempt.engine).observe(tbot_s)
            fleet.observe(index, Ewma.TBOT_S, tbot_s)
        if ctx.aggregator is not None:
            engine_id = int(fleet.engine_ids[index])
            ctx.aggregator.observe_latency(engine_id, first_at - state.t0, tbot_s)
            ctx.aggregator.observe_output(int(fleet.row_keys[state.row]), n_tokens)
