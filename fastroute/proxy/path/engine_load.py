"""Per-engine load and in-band calibration for the ``marginal-cost`` policy.

Only classes whose policy is ``marginal-cost`` use this module; every other policy's
request path never touches it.

:class:`EngineLoad` keeps one fleet's :class:`~fastroute.policy.marginal.EngineState`
(what the policy reads) from two sources:

* **this worker's bookkeeping**, exact for its own requests: an attempt is *queued*
  (its prompt tokens in ``queued_prefill_tokens``, one in ``queued_requests``) from
  the moment it is forwarded until its first streamed token, then *running* (one
  sequence in ``running_seqs``, prompt plus streamed tokens in
  ``running_context_tokens``, added :data:`FLUSH_TOKENS` at a time) until it ends.
  ``kv_used_tokens`` is the sum of both.
* **the engine scrapes** (``proxy.scrape_engines``), engine-wide but up to a scrape
  interval old: on each new scrape round, the running and waiting requests (and the
  KV usage times the type's nominal capacity) the engine reports beyond this worker's
  own become an offset added to the columns, so other workers' and other routers'
  requests count too. A scrape older than :data:`MAX_SCRAPE_AGE_S` is ignored.

The remaining columns: ``kv_capacity_tokens`` is the engine type's nominal capacity
(the emulator profile of its ``hardware`` name; 0 = unknown, no KV check);
``running_remaining_tokens`` is NaN (the policy then assumes ``B·min(N̂, E[N])``);
``arrival_rate_rps`` and ``network_s`` are 0 (no FCFS externality; loopback-scale
network); ``prefill_tokens_per_step`` is the engine's
:attr:`~fastroute.predict.interleave.PrefillInterleave.expected` (below). Beside the matrix,
``prefix_hit_rate`` is each engine's windowed prefix-cache hit rate from the same scrapes (NaN
when unknown, idle or stale).

Each tracked attempt is an :class:`AttemptLoad`. When it ends successfully its
timings calibrate the policy's :class:`~fastroute.predict.FleetCalibration`
(one ``observe_*`` call each, bounded cost per request):

* a stream: ``observe_prefill`` with the in-band TTFT (forward → first token event) over the
  prompt's uncached tokens (``usage.prompt_tokens_details.cached_tokens`` when the
  engine sent usage, else 0) and the load it met on arrival; ``observe_decode`` with
  the mean time between output tokens (TBOT, token-true: see
  :class:`~fastroute.proxy.path.sse.StreamMeter`) at the batch and context it ran beside and the
  prompt tokens per decode step prefilled on the engine meanwhile (the mixed-step
  feature: :class:`~fastroute.predict.interleave.PrefillInterleave`: every
  non-decode-stage attempt's prompt is counted at its first token, or at the end of a
  JSON answer; an attempt marks the count at its first token and reads it at its end);
* a JSON answer of one output token (the prefill step of a P/D request):
  ``observe_prefill`` with the whole attempt's duration;
* and in both cases the output length (``usage.completion_tokens``, else the streamed
  events) goes to ``policy.observe_output``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from fastroute.config import EngineConfig
from fastroute.hashing import engine_id
from fastroute.policy.base import RouteRequest
from fastroute.policy.marginal import EngineState, MarginalCost, StateColumn
from fastroute.predict.calibration import DEFAULT_TYPE
from fastroute.predict.interleave import PrefillInterleave

if TYPE_CHECKING:
    from fastroute.proxy.background.scraper import EngineScraper

__all__ = [
    "AttemptLoad",
    "EngineLoad",
    "FLUSH_TOKENS",
    "MAX_SCRAPE_AGE_S",
    "MIN_SAMPLES_TO_REJECT",
    "parse_usage",
]

#: Scrapes older than this (seconds) no longer add to the bookkeeping.
MAX_SCRAPE_AGE_S = 10.0
#: Observations of each kind every engine type of a fleet needs before a request the
#: policy finds SLO-infeasible is rejected (:meth:`EngineLoad.calibrated`). Before that the
#: costs come from nominal constants that may be far off (an unknown ``hardware`` name
#: starts from the A40's), and a rejected request never calibrates them.
MIN_SAMPLES_TO_REJECT = 20
#: Streamed tokens are added to the engine's context in batches of this many (numpy
#: element updates per chunk were most of the bookkeeping's cost; S moves little per token).
FLUSH_TOKENS = 16
#: Context tokens assumed per request the scrape reports beyond this worker's own,
#: when this worker has no running request on the engine to take a mean from.
DEFAULT_CONTEXT_TOKENS = 1024.0

# Columns of EngineState.values, bound to plain ints for the per-token bookkeeping.
_Q_TOK = int(StateColumn.QUEUED_PREFILL_TOKENS)
_Q_REQ = int(StateColumn.QUEUED_REQUESTS)
_B = int(StateColumn.RUNNING_SEQS)
_S = int(StateColumn.RUNNING_CONTEXT_TOKENS)
_KV_USED = int(StateColumn.KV_USED_TOKENS)
_KV_CAP = int(StateColumn.KV_CAPACITY_TOKENS)
_TYPE = int(StateColumn.ENGINE_TYPE)
_MIX = int(StateColumn.PREFILL_TOKENS_PER_STEP)


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _Details | None = None


class _WithUsage(msgspec.Struct):
    usage: _Usage | None = None


_usage_decoder = msgspec.json.Decoder(_WithUsage)


def parse_usage(data: bytes) -> _Usage | None:
    """The ``usage`` object of a JSON body or of one SSE event's data, or None."""
    try:
        return _usage_decoder.decode(data).usage
    except msgspec.DecodeError:
        return None


class AttemptLoad:
    """One tracked attempt on one engine (see :meth:`EngineLoad.admit`)."""

    __slots__ = (
        "load",
        "index",
        "route",
        "prompt_tokens",
        "started_s",
        "batch0",
        "context0",
        "queued0",
        "first_s",
        "last_s",
        "mix_mark",
        "events",
        "flushed",
        "usage",
        "released",
        "decode_stage",
    )

    def __init__(
        self,
        load: EngineLoad,
        index: int,
        route: RouteRequest,
        started_s: float,
        decode_stage: bool = False,
    ) -> None:
        row = load.state.values[index]
        self.load = load
        self.index = index
        self.route = route
        self.prompt_tokens = max(1, int(route.prompt_tokens))
        self.started_s = started_s
        # The load the request met on arrival: the features of its TTFT.
        self.batch0 = float(row[_B])
        self.context0 = float(row[_S])
        self.queued0 = float(row[_Q_TOK])
        self.first_s = math.nan
        self.last_s = math.nan
        self.mix_mark = 0.0  # the engine's prefilled prompt tokens at the first token
        self.events = 0
        self.flushed = 0  # events already added to the engine's context
        self.usage: _Usage | None = None
        self.released = False
        # The decode step of a P/D request: its TTFT is KV transfer + first step, not a
        # prefill, so only its TBOT and output length calibrate.
        self.decode_stage = decode_stage

    def first_token(self, now_s: float) -> None:
        """The first output token arrived: queued → running."""
        if self.first_s == self.first_s:  # already running
            return
        self.first_s = self.last_s = now_s
        mix = self.load.interleave
        if not self.decode_stage:
            mix.prefilled(self.index, self.prompt_tokens)  # its prefill is done
        self.mix_mark = mix.mark(self.index)
        v = self.load.state.values
        n = self.prompt_tokens
        v[self.index, _Q_TOK] -= n
        v[self.index, _Q_REQ] -= 1
        v[self.index, _B] += 1
        v[self.index, _S] += n

    def tokens(self, events: int, now_s: float) -> None:
        """``events`` more streamed events carried output tokens (at ``now_s``); the
        stream's ``usage`` is set by the relay at its end."""
        self.events += events
        self.last_s = now_s
        pending = self.events - self.flushed
        if pending >= FLUSH_TOKENS:
            self.flushed = self.events
            v = self.load.state.values
            v[self.index, _S] += pending
            v[self.index, _KV_USED] += pending

    def body(self, data: bytes) -> None:
        """A JSON answer was read whole."""
        self.usage = parse_usage(data)


class EngineLoad:
    """The :class:`~fastroute.policy.marginal.EngineState` of one fleet, and the
    in-band calibration of ``policy`` from the attempts tracked on it.

    Parameters
    ----------
    engines : sequence of EngineConfig
        The fleet's engines, in fleet order (the state's rows): their names, ids
        (:func:`~fastroute.hashing.engine_id` of the name) and ``hardware`` types.
    policy : MarginalCost
        Whose ``calibration`` (by engine ``hardware``) and ``output_lengths`` the
        observed timings feed.
    scraper : EngineScraper, optional
        Engine scrapes to merge (see the module docstring).
    """

    def __init__(
        self,
        engines: Sequence[EngineConfig],
        policy: MarginalCost,
        scraper: EngineScraper | None = None,
    ) -> None:
        self.policy = policy
        self.calibration = policy.calibration
        self.scraper = scraper
        self.names = [e.name for e in engines]
        self.engine_ids = [engine_id(e.name) for e in engines]
        self.types = [e.hardware or DEFAULT_TYPE for e in engines]
        type_names = tuple(sorted(set(self.types))) or (DEFAULT_TYPE,)
        self.state = EngineState(len(self.names), type_names)
        v = self.state.values
        for i, t in enumerate(self.types):
            v[i, _TYPE] = type_names.index(t)
            v[i, _KV_CAP] = self.calibration.model(t).kv_capacity_tokens
        # What the last merged scrape added beyond this worker's own (B, q_r, S, kv).
        self._offset = np.zeros((len(self.names), 4))
        self._round = -1
        #: Prompt tokens prefilled per engine, for the mixed-step decode feature.
        self.interleave = PrefillInterleave(len(self.names))
        #: Observations folded into the calibration (for tests and the record).
        self.observed = 0

    def calibrated(self, kinds: tuple[str, ...] = ("prefill", "decode")) -> bool:
        """Whether every engine type of the fleet has :data:`MIN_SAMPLES_TO_REJECT`
        observations of each of ``kinds`` (always true when calibration is off: the
        nominal constants are then what the operator chose)."""
        if not self.calibration.calibrate:
            return True
        for t in self.state.type_names:
            counts = self.calibration.model(t).samples_by_kind
            if any(counts[k] < MIN_SAMPLES_TO_REJECT for k in kinds):
                return False
        return True

    # -- the view's side ---------------------------------------------------------------------

    def engine_state(self) -> EngineState:
        """The state, with a new scrape round merged first (once per round)."""
        scraper = self.scraper
        if scraper is not None and scraper.rounds_total != self._round:
            self._round = scraper.rounds_total
            self._merge(scraper, time.time())
        return self.state

    def _merge(self, scraper: EngineScraper, now_s: float) -> None:
        v = self.state.values
        offset = self._offset
        v[:, [_B, _Q_REQ, _S, _KV_USED]] -= offset
        offset[:] = 0.0
        hit_rate = self.state.prefix_hit_rate
        hit_rate[:] = np.nan
        for i, name in enumerate(self.names):
            result = scraper.results.get(name)
            signals = None if result is None else result.signals
            if signals is None or now_s - signals.scraped_at_s > MAX_SCRAPE_AGE_S:
                continue
            rate = result.prefix_hits.current.rate  # type: ignore[union-attr]
            if rate is not None:
                hit_rate[i] = rate
            b_own, q_own = v[i, _B], v[i, _Q_REQ]
            mean_ctx = v[i, _S] / b_own if b_own > 0 else DEFAULT_CONTEXT_TOKENS
            if signals.num_requests_running is not None:
                offset[i, 0] = max(0.0, signals.num_requests_running - b_own)
                offset[i, 2] = offset[i, 0] * mean_ctx
            if signals.num_requests_waiting is not None:
                offset[i, 1] = max(0.0, signals.num_requests_waiting - q_own)
            if signals.kv_cache_usage is not None and v[i, _KV_CAP] > 0:
                offset[i, 3] = max(0.0, signals.kv_cache_usage * v[i, _KV_CAP] - v[i, _KV_USED])
        v[:, [_B, _Q_REQ, _S, _KV_USED]] += offset

    # -- attempts ----------------------------------------------------------------------------

    def admit(
        self, index: int, route: RouteRequest, now_s: float, *, decode_stage: bool = False
    ) -> AttemptLoad:
        """An attempt was forwarded to engine ``index``: it is queued there.

        ``decode_stage``: the decode step of a P/D request (queued while its KV
        arrives; its TTFT does not calibrate the prefill model).
        """
        attempt = AttemptLoad(self, index, route, now_s, decode_stage)
        v = self.state.values
        v[index, _Q_TOK] += attempt.prompt_tokens
        v[index, _Q_REQ] += 1
        v[index, _KV_USED] += attempt.prompt_tokens
        return attempt

    def release(self, attempt: AttemptLoad, ok: bool, now_s: float) -> None:
        """The attempt ended: take it off the engine, and calibrate from it if ``ok``."""
        if attempt.released:
            return
        attempt.released = True
        v = self.state.values
        i, n = attempt.index, attempt.prompt_tokens
        if attempt.first_s == attempt.first_s:
            v[i, _B] -= 1
            v[i, _S] -= n + attempt.flushed
            v[i, _KV_USED] -= n + attempt.flushed
        else:
            v[i, _Q_TOK] -= n
            v[i, _Q_REQ] -= 1
            v[i, _KV_USED] -= n
            if ok and not attempt.decode_stage:  # a JSON answer: prefilled by now
                self.interleave.prefilled(i, n)
        if ok:
            self._calibrate(attempt, now_s)

    def _calibrate(self, a: AttemptLoad, now_s: float) -> None:
        usage = a.usage
        n, c, out = a.prompt_tokens, 0, a.events
        if usage is not None:
            if usage.prompt_tokens:
                n = usage.prompt_tokens
            if usage.completion_tokens is not None:
                out = usage.completion_tokens
            details = usage.prompt_tokens_details
            if details is not None and details.cached_tokens:
                c = min(max(0, details.cached_tokens), n - 1)
            if not a.decode_stage:
                self.interleave.observe_cached(a.index, n, c)
        cal = self.calibration
        t, eid = self.types[a.index], self.engine_ids[a.index]
        batch, context = int(a.batch0), int(a.context0)
        if a.first_s == a.first_s:  # streamed: TTFT and TBOT
            ttft = a.first_s - a.started_s
            self._outcome(a, out)
            if ttft > 0 and not a.decode_stage:
                cal.observe_prefill(
                    t, eid, n - c, c, ttft,
                    batch=batch, context=context, queued_tokens=int(a.queued0),
                )  # fmt: skip
                self.observed += 1
            if a.events > 1 and out > 1 and a.last_s > a.first_s:
                steps = out - 1  # the span first..last token event covers out - 1 tokens
                tbot = (a.last_s - a.first_s) / steps
                mix = self.interleave.per_step(a.index, a.mix_mark, steps)
                self.state.values[a.index, _MIX] = self.interleave.expected[a.index]
                cal.observe_decode(
                    t, eid, batch + 1, int(context + n + out / 2), tbot,
                    prefill_tokens_per_step=mix,
                )  # fmt: skip
                self.observed += 1
        elif out == 1 and now_s > a.started_s:  # one token, whole: a prefill step
            cal.observe_prefill(
                t, eid, n - c, c, now_s - a.started_s,
                batch=batch, context=context, queued_tokens=int(a.queued0),
            )  # fmt: skip
            self.observed += 1
        if out > 1 or a.first_s == a.first_s:
            self.policy.observe_output(a.route, max(1, out), now_s)

    def _outcome(self, a: AttemptLoad, out: int) -> None:
        """A streamed attempt's realised TTFT and TPOT, for the policy's reject bound. A
        P/D decode stage's TTFT (KV transfer + first step) is not the client's: only its
        TPOT counts; the prefill stage (one token) reports nothing."""
        steps = out - 1
        tpot = (a.last_s - a.first_s) / steps if a.events > 1 and steps > 0 else None
        ttft = None if a.decode_stage else a.first_s - a.started_s
        if ttft is not None or tpot is not None:
            self.policy.observe_outcome(a.route, ttft, tpot)
