"""A P/D request the SGLang way: the same request to both engines at once, one room.

SGLang's disaggregated serving has no prefill answer the decode step waits for: the
router picks a prefill and a decode engine and sends both the client's body plus
``bootstrap_host`` (the prefill engine's host), ``bootstrap_port`` (its disaggregation
bootstrap port, ``engines[].bootstrap_port``) and ``bootstrap_room`` (a random 63-bit
id, fresh per attempt). The decode engine reaches the prefill engine's bootstrap server
with the room and receives the KV when the prefill is done; the client gets the decode
engine's response, streamed or not. The prefill engine's answer (one token) is read and
thrown away, but for its ``cached_tokens``, which replace the decode engine's in the
client's usage (:mod:`fastroute.proxy.path.pd_usage`; a stream's usage event is
rewritten with the prefill's count if its answer has arrived by then, which it has in
all but the most contrived timings: the decode cannot start before the prefill ends).

Both requests are attempts of :meth:`Forwarder.attempt
<fastroute.proxy.path.forward.Forwarder.attempt>`, each on its pool's request state, so
in-flight counts, outlier outcomes and policy hooks are each pool's own, as for
:mod:`fastroute.proxy.path.pd_stages`. Failures:

* The prefill fails (non-2xx or no answer) before the decode engine started the
  client's response: the decode attempt is cancelled (it would wait for KV that never
  comes; cancelling is not the decode engine's failure), and the prefill engine's
  failure counts against it. A retryable failure moves to the next ranked prefill
  engine, a fresh room and the same decode engine; the other failures are the client's
  answer. Once the decode engine has begun the client's response, it stands.
* The decode fails before its first byte: the prefill attempt is cancelled (its KV is
  for a room nobody will claim) and a retryable failure moves to the next ranked decode
  engine, with the same prefill engine and a fresh room.

Each stage retries within the retry budget as a step of vLLM's protocol does: its n-th
next engine is the budget's n-th retry, whatever the other stage did.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import msgspec

from fastroute.config import EngineConfig, bootstrap_port_of
from fastroute.policy import Decision
from fastroute.proxy.http.openai_errors import error_reply
from fastroute.proxy.http.reply import Headers, Reply
from fastroute.proxy.http.upstream import UpstreamError
from fastroute.proxy.path.decisions import DecisionRecord
from fastroute.proxy.path.headers import decision_headers
from fastroute.proxy.path.outcomes import Retryable
from fastroute.proxy.path.pd_usage import (
    CachedTokensSink,
    prefill_cached_tokens,
    stream_cached_tokens,
    with_prefill_cached,
)
from fastroute.proxy.path.request_state import RequestState

if TYPE_CHECKING:
    from fastroute.proxy.path.forward import Forwarder
    from fastroute.proxy.path.handler import ProxyContext

__all__ = ["BootstrapPair", "bootstrap_body", "bootstrap_address", "ROOM_BITS"]

#: Bits of a ``bootstrap_room`` (SGLang's routers draw a random 63-bit integer).
ROOM_BITS = 63
#: Bytes of a streamed prefill answer kept to read its usage from (one token's events).
MAX_PREFILL_ANSWER_BYTES = 64 * 1024
#: How long a decoded JSON answer waits for the prefill's (for its ``cached_tokens``);
#: past it the prefill attempt is cancelled and the answer has no ``cached_tokens``.
PREFILL_ANSWER_GRACE_S = 1.0


def bootstrap_address(engine: EngineConfig) -> tuple[str, int]:
    """The (``bootstrap_host``, ``bootstrap_port``) a decode engine reaches ``engine`` on."""
    host = urlsplit(engine.url).hostname
    assert host is not None  # validated: every engine url has a host
    return host, bootstrap_port_of(engine)


def bootstrap_body(request: dict[str, Any], host: str, port: int, room: int) -> bytes:
    """The body both engines get: the client's request plus the three bootstrap fields."""
    body = dict(request)
    body["bootstrap_host"] = host
    body["bootstrap_port"] = port
    body["bootstrap_room"] = room
    return msgspec.json.encode(body)


class _PrefillSink:
    """The prefill attempt's sink: a streamed answer is kept (bounded) for its usage."""

    def __init__(self) -> None:
        self.data = bytearray()

    async def start(self, status: int, headers: Headers, raw_head: bytes = b"") -> None:
        return None

    async def write(self, data: bytes) -> None:
        room = MAX_PREFILL_ANSWER_BYTES - len(self.data)
        if room > 0:
            self.data += data[:room]

    async def end(self) -> None:
        return None

    def splice(self) -> None:
        return None


@dataclasses.dataclass(slots=True)
class _Failed:
    """A failed attempt of one stage: the failure, and whether the next engine may be tried."""

    stage: str
    failure: UpstreamError | Reply
    retryable: bool


class BootstrapPair:
    """Serves the P/D requests of the models whose engines are SGLang's.

    Parameters
    ----------
    ctx : ProxyContext
    forwarder : Forwarder
    """

    def __init__(self, ctx: ProxyContext, forwarder: Forwarder) -> None:
        self.ctx = ctx
        self.forwarder = forwarder

    async def forward(
        self, state: RequestState, prefill: RequestState, p_dec: Decision, d_dec: Decision
    ) -> Reply:
        """Pair attempts down both rankings until one answers or retries run out.

        ``state`` is pointed at the decode stage (the client's sink), ``prefill`` (a copy)
        at the prefill stage; both bodies are set per attempt.
        """
        record = state.record
        original = msgspec.json.decode(state.body or b"{}")
        client = CachedTokensSink(state.sink, None)
        state.sink = client
        ranked = {"prefill": p_dec.ranked, "decode": d_dec.ranked}
        ranks = {"prefill": 0, "decode": 0}
        last: _Failed | None = None
        for _ in range(len(p_dec.ranked) + len(d_dec.ranked) - 1):  # one rank down per failure
            p_rank, d_rank = ranks["prefill"], ranks["decode"]
            assert prefill.fleet is not None
            engine = prefill.fleet.engines[p_dec.ranked[p_rank]]
            host, port = bootstrap_address(engine)
            room = secrets.randbits(ROOM_BITS)
            record.bootstrap_room = room
            prefill.body = state.body = bootstrap_body(original, host, port, room)
            result = await self._pair(
                state, prefill, (p_rank, p_dec.ranked[p_rank]), (d_rank, d_dec.ranked[d_rank])
            )
            if isinstance(result, Reply):
                return result
            last = result
            ranks[result.stage] += 1
            if not result.retryable or not self._may_retry(
                ranks[result.stage], ranked[result.stage], record
            ):
                break
        assert last is not None
        if isinstance(last.failure, Reply):
            return last.failure
        return error_reply(
            last.failure.status,
            last.failure.message,
            code=last.failure.code,
            headers=decision_headers(record),
        )

    def _may_retry(self, rank: int, ranked: Sequence[int], record: DecisionRecord) -> bool:
        """Whether the failed stage may go on at ``rank`` of its ranking: each stage
        retries within the budget as a P/D step does (``Forwarder.try_ranked``)."""
        budget = self.ctx.budget
        if rank >= len(ranked):
            return False
        if not budget.may_retry(rank - 1, time.monotonic()):
            if rank <= budget.max_retries:
                self.ctx.metrics.retry_refused.inc()
                record.error = "retry refused by the retry budget"
            return False
        self.ctx.metrics.retries.inc()
        return True

    async def _pair(
        self,
        state: RequestState,
        prefill: RequestState,
        p_at: tuple[int, int],
        d_at: tuple[int, int],
    ) -> Reply | _Failed:
        """One pair attempt: both requests at once; the client's reply or a failure."""
        client = state.sink
        assert isinstance(client, CachedTokensSink)
        client.cached = None
        p_task = state.loop.create_task(self._prefill(prefill, client, *p_at))
        d_task = state.loop.create_task(self.forwarder.attempt(state, *d_at))
        try:
            await asyncio.wait((p_task, d_task), return_when=asyncio.FIRST_COMPLETED)
            if p_task.done():
                p_result = p_task.result()
                if isinstance(p_result, _Failed) and not client.started:
                    await _cancel(d_task, state, "decode", "the prefill failed")
                    return p_result
            try:
                reply = await d_task
            except Retryable as exc:
                await _cancel(p_task, prefill, "prefill", "the decode failed")
                return _Failed("decode", exc.failure, retryable=True)
            if reply.status != 200:
                await _cancel(p_task, prefill, "prefill", "the decode failed")
                return reply
            # The prefill has answered, or its answer is on the way (the KV was sent).
            await asyncio.wait((p_task,), timeout=PREFILL_ANSWER_GRACE_S)
            p_result = p_task.result() if p_task.done() else None
            if not reply.streamed and not isinstance(p_result, _Failed):
                reply.body = with_prefill_cached(reply.body, p_result)
            return reply
        finally:
            await _cancel(p_task, prefill, "prefill", "the request ended")
            await _cancel(d_task, state, "decode", "the request ended")

    async def _prefill(
        self, prefill: RequestState, client: CachedTokensSink, rank: int, index: int
    ) -> int | None | _Failed:
        """The prefill attempt: its answer's ``cached_tokens`` (also given to the client's
        sink at once, for a stream's usage event), or how it failed."""
        sink = _PrefillSink()
        prefill.sink = sink
        try:
            reply = await self.forwarder.attempt(prefill, rank, index)
        except Retryable as exc:
            return _Failed("prefill", exc.failure, retryable=True)
        if reply.status != 200:
            return _Failed("prefill", reply, retryable=False)
        attempt = next(a for a in reversed(prefill.record.attempts) if a.stage == "prefill")
        if attempt.outcome != "success":  # a stream that failed midway: no KV for the room
            why = f"the prefill engine {attempt.engine} failed mid-answer ({attempt.outcome})"
            failed = error_reply(
                502, why, code="upstream_error", headers=decision_headers(prefill.record)
            )
            return _Failed("prefill", failed, retryable=False)
        prefill.record.timings["prefilled"] = prefill.loop.time() - prefill.t0
        if reply.streamed:
            cached = stream_cached_tokens(bytes(sink.data))
        else:
            cached = prefill_cached_tokens(reply.body)
        client.cached = cached
        return cached


async def _cancel(task: asyncio.Task[Any], state: RequestState, stage: str, why: str) -> None:
    """Cancel a stage's attempt if it still runs; its record entry says why."""
    if task.done():
        exc = None if task.cancelled() else task.exception()
        if exc is not None and not isinstance(exc, Retryable):
            raise exc  # a bug, not an engine's failure: never swallowed
        return
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Retryable):
        pass
    for attempt in reversed(state.record.attempts):
        if attempt.stage == stage and attempt.outcome == "pending":
            attempt.outcome = "cancelled"
            attempt.detail = why
            break
