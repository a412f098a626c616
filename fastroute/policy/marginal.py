"""``marginal-cost``: calibrated marginal completion time over the top-k rendezvous candidates.

Algorithm (docs/algorithms.md §6.4; "Calibrate, Then Route", arXiv 2609.16206)
    For request ``r`` (prompt ``n`` tokens, ``c_e`` of them cached on engine ``e``,
    predicted output ``N̂``) the policy evaluates only the **top-k rendezvous
    candidates** of the routing key in the class row (``candidates``, default 3), so
    the controller's macro split and the key's KV affinity are kept and the cost is
    O(k) model evaluations. For each candidate, with its load (:class:`EngineState`:
    ``q`` queued prompt tokens in ``q_r`` requests, ``B`` running sequences of total
    context ``S``, ``R`` their expected remaining tokens) and the calibrated
    coefficients of its type times its residuals ``ρ_e`` (prefill) and ``δ_e`` (decode)
    (:class:`~fastroute.predict.FleetCalibration`)::

        base   = b0 + b1·B + b2·S  if B > 0  else a0        per-step cost while prefilling
        Wq     = ρ_e · chunked prefill of the q queued tokens
        pf     = ρ_e · chunked prefill of (n − c_e) new over c_e cached tokens
        TTFT   = net_e + Wq + pf
        TPOT   = δ_e · (b0 + b1·(B + q_r + 1) + b2·(S + q + n + N̂/2) + m1·p_e)
        own    = TTFT + (N̂ − 1)·TPOT
        ext    = B · δ_e·m1·(n − c_e)                       running decodes slowed by our chunks
               + δ_e·(b1 + b2·(n + N̂/2)) · (min(B·N̂, R) + q_r·N̂)   co-running steps slowed
               + λ_e · pf² / (2(1 − min(0.9, λ_e·pf)))       later arrivals pushed back (FCFS)
        MC     = own + ext

    ``m1`` (``a1'`` of docs/algorithms.md §6.3's mixed step) is the calibrated decode-step time
    per prefill token run beside it, and ``p_e`` the prefill tokens expected beside each
    decode step on ``e`` (``prefill_tokens_per_step``: what the data plane measured on the
    engine's recent requests; 0 on a decode-only engine). Both interference terms use
    ``m1``, fitted from measured TBOTs, rather than the prefill chunk's own compute time:
    what a decode loses to a chunk beside it is what the TBOT fit sees.

    ``min(B·N̂, R)`` bounds ``Σ_j min(N̂, R̂_j)`` (exact when every running request
    outlives, or every one ends before, the new one); without ``R`` it is
    ``B·min(N̂, E[N])``. The FCFS term uses the request's own ``pf`` as the mean
    prefill time in the utilisation estimate.

    **Feasible** candidates meet the request's SLOs (``TTFT <= slo_ttft_s`` and
    ``TPOT <= slo_tpot_s``; per-request values of :class:`MarginalRequest`, else the
    policy's class defaults; ``None`` = no constraint) and fit in the KV cache
    (``kv_used + q + (n − c_e) + N̂ <= kv_capacity``, when the capacity is known). The
    choice is the feasible candidate of least MC. If no candidate is feasible and the
    request has an SLO, every other eligible engine is evaluated (O(n), rare); if one
    is feasible it is chosen (reason ``"slo-spill"``), else the decision has an empty
    ranking and reason ``"slo-infeasible"`` (:data:`REASON_SLO_INFEASIBLE`; the proxy
    answers 429 early instead of sending a doomed request) with the predictions in
    ``detail`` — if the reject bound allows it (below). Without an SLO an over-full KV
    cache only demotes: the least-MC candidate is chosen (reason ``"kv-full"``).

Rejection checked against outcomes
    A rejected request produces no sample, so a model that drifts pessimistic would reject
    every request for ever. Before each rejection the policy asks its
    :class:`~fastroute.predict.reject_bound.RejectBound` (one per SLO,
    :meth:`MarginalCost.reject_bound`): every
    ``round(1 / probe_rate)``-th predicted-infeasible request is a probe, and no rejection
    may take the recent reject fraction above the recent admitted requests' measured miss
    fraction. A request it admits is routed by least MC (reason ``"slo-probe"``,
    :data:`REASON_SLO_PROBE`). The data plane reports realised latencies with
    :meth:`MarginalCost.observe_outcome`.

Scarcity guard (the paper's failure mode)
    Greedy argmin concentrates load when every candidate is nearly as expensive (the
    paper: 1P+2D goodput 0.292 against round robin's 0.680), and the engine state the
    costs are computed from lags the decisions. Candidates within ``near_tie`` (relative)
    of the best are **near-ties**; among two or more, two are sampled at random and the
    one with fewer in-flight requests wins (the proxy's live counters move at once,
    unlike the engines' reported queues), ties by MC (reason ``"near-tie-p2c"``).
    ``near_tie = 0`` turns the guard off: pure argmin, exact ties to the rendezvous order.

Prefix cache
    ``c_e`` comes from the view when it can say (:meth:`EngineStateView.cached_prefix_tokens`:
    the simulator knows the engines' block hashes exactly; a proxy could use engine-
    reported hit estimates), else from this policy's own radix tree of routed prefixes
    (:class:`~fastroute.policy.prefix_tree.PrefixTree`, as ``cache-aware``): the matched
    fraction of the request's prefix bytes times its prompt tokens (when the prefix is
    the whole prompt) or the matched bytes over ``bytes_per_token`` (when the prefix was
    truncated at ``max_prefix_bytes``). A candidate holding the prefix prefills only
    ``n − c_e`` tokens, so a long shared prefix makes its engine cheap.

Disaggregated prefill/decode
    :meth:`MarginalCost.choose_pair` scores every (prefill, decode) pair of the two
    pools' top-k candidates (k² pairs): prefill side as above with ``TTFT_p``, the KV
    transfer ``T_x(n − c_d)`` from the calibrated transfer model, the decode side's
    first step and ``(N̂ − 1)·TPOT_d``, plus both externalities.

Uncalibrated baseline
    ``calibrate=False`` keeps the nominal constants of each engine type (no online
    updates), the "uncalibrated" arm of the experiments.

Interface
    Same :class:`~fastroute.policy.base.Policy` contract as the others: on a plain
    :class:`~fastroute.policy.base.FleetView` (no :meth:`EngineStateView.engine_state`)
    the load falls back to in-flight requests as the running batch, nothing queued and
    unknown KV capacity, so the policy degrades to queue counting with a prefix bonus.

Tunables
    ``candidates`` : int >= 1; default 3. Rendezvous candidates evaluated.
    ``slo_ttft_s``, ``slo_tpot_s`` : float > 0 or None, seconds; default None.
        Class defaults (a :class:`MarginalRequest` may override per request).
    ``near_tie`` : float >= 0, relative; default 0.05.
    ``infeasible`` : ``"reject"`` (default) or ``"deprioritise"``. What to do with a
        request no engine is predicted to serve within its SLO: reject it (empty ranking,
        the proxy answers 429), or route it anyway: behind the **longest** predicted wait
        among candidates whose queue wait alone exceeds the TTFT SLO (reason
        ``"slo-deprioritised"``; under P/D that prefill engine and its cheapest decode
        partner) — it misses either way, and there it delays the fewest requests that can
        still meet theirs — or, if no candidate is that overloaded (the request is too big
        for its SLO anywhere), by least MC (reason ``"slo-miss-least-cost"``).
    ``probe_rate`` : float in (0, 1]; default 0.05. Fraction of the predicted-infeasible
        requests routed anyway (every 20th: a fully pessimistic model is probed within 20
        such arrivals; a real overload admits 5 % of what the model would reject).
    ``reject_window`` : int >= 1, requests; default 100. Decisions and admitted outcomes
        the reject and miss fractions are measured over.
    ``engine_type`` : str; default ``"a40"``. Type of engines the view does not type.
    ``calibrate`` : bool; default True.
    ``bytes_per_token`` : float > 0; default 4.0 (English text, Llama-3 tokenizer).
    ``max_prefix_bytes`` : int >= 1; default 16384. ``max_tree_size`` : int >= 1,
        bytes per engine; default ``2**22`` (as ``cache-aware``).
    ``seed`` / ``rng`` : randomness of the near-tie sampling (as ``power-of-two``).
    ``calibration`` : FleetCalibration or None; ``output_lengths`` :
        OutputLengthPredictor or None — share the data plane's instances (fed with
        observed timings and output lengths); fresh ones otherwise.

Cost per request
    One rendezvous rank of ``max(k, candidates)``, one prefix-tree match, O(k) scalar
    model evaluations in Python floats (no array is allocated). Benchmark:
    ``bench/test_bench_marginal.py``.

``Decision.scores`` are the MC values (seconds) of the ranked engines; the decision is
a :class:`MarginalDecision` carrying the chosen engine's predicted TTFT, TPOT, output
length and cached tokens.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from enum import IntEnum
from operator import itemgetter
from typing import Any, ClassVar, Protocol, runtime_checkable

import msgspec
import numpy as np

from fastroute.policy.base import (
    DEFAULT_K,
    Decision,
    FleetView,
    Policy,
    PolicyConfigError,
    RouteRequest,
    StaticFleetView,
    check_k,
)
from fastroute.policy.prefix_tree import PrefixTree
from fastroute.predict.calibration import DEFAULT_TYPE, FleetCalibration
from fastroute.predict.output_length import OutputLengthPredictor
from fastroute.predict.reject_bound import (
    DEFAULT_PROBE_RATE,
    DEFAULT_REJECT_WINDOW,
    RejectBound,
    Verdict,
)
from fastroute.predict.step_time import StepTimeModel, chunk_sums

__all__ = [
    "COLUMNS",
    "EngineState",
    "EngineStateView",
    "MarginalCost",
    "MarginalDecision",
    "MarginalPairs",
    "MarginalRequest",
    "PairDecision",
    "REASON_SLO_DEPRIORITISED",
    "REASON_SLO_INFEASIBLE",
    "REASON_SLO_PROBE",
    "StateColumn",
    "StaticEngineStateView",
]

#: ``Decision.reason`` when no engine is predicted to meet the request's SLO.
REASON_SLO_INFEASIBLE = "slo-infeasible"
#: ``Decision.reason`` when no engine meets the SLO and ``infeasible="deprioritise"``.
REASON_SLO_DEPRIORITISED = "slo-deprioritised"
#: Distinct SLOs (TTFT, TPOT pairs) whose reject bounds are kept (oldest forgotten first).
MAX_REJECT_BOUNDS = 64
#: ``Decision.reason`` when no engine is predicted to meet the SLO but the request is
#: admitted anyway (least MC): a probe, or a rejection the attainment bound forbids.
REASON_SLO_PROBE = "slo-probe"


class StateColumn(IntEnum):
    """Columns of :attr:`EngineState.values`, in order (described on :class:`EngineState`).

    Hot loops bind the members to module-level ints (``_RUNNING = int(StateColumn.X)``)
    or unpack a row in this order, rather than look an attribute up per call.
    """

    QUEUED_PREFILL_TOKENS = 0
    QUEUED_REQUESTS = 1
    RUNNING_SEQS = 2
    RUNNING_CONTEXT_TOKENS = 3
    RUNNING_REMAINING_TOKENS = 4
    KV_USED_TOKENS = 5
    KV_CAPACITY_TOKENS = 6
    ARRIVAL_RATE_RPS = 7
    NETWORK_S = 8
    ENGINE_TYPE = 9
    PREFILL_TOKENS_PER_STEP = 10


#: Names of :attr:`EngineState.values`'s columns, in order (the lower-case member names).
COLUMNS = tuple(c.name.lower() for c in StateColumn)
_COL = {name: StateColumn(i) for i, name in enumerate(COLUMNS)}
_ENGINE_TYPE = int(StateColumn.ENGINE_TYPE)


class EngineState:
    """Per-engine load the marginal-cost policy reads beyond :class:`FleetView`.

    One float64 matrix, row = engine (table order, as ``in_flight()``), column =
    :data:`COLUMNS`; the owner (proxy or simulator) updates it in place, the policy
    reads one row per candidate. Columns, all per engine:

    ``queued_prefill_tokens``
        Prompt tokens accepted but not yet prefilled (waiting queue, and the
        unprefilled part of partially prefilled prompts).
    ``queued_requests``
        Requests waiting (vLLM ``num_requests_waiting``; on a decode engine those whose
        KV is still arriving).
    ``running_seqs``
        B: sequences in the running batch (vLLM ``num_requests_running``).
    ``running_context_tokens``
        S: their total context (prompt + generated) tokens.
    ``running_remaining_tokens``
        Σ of the running requests' expected remaining output tokens
        (:meth:`OutputLengthPredictor.remaining` of each); NaN if unknown.
    ``kv_used_tokens``, ``kv_capacity_tokens``
        KV-cache use and capacity in tokens (vLLM ``kv_cache_usage_perc`` × capacity);
        capacity 0 = unknown (no KV check).
    ``arrival_rate_rps``
        Recent request arrival rate at the engine (EWMA), requests per second; 0 if
        unknown (no FCFS externality).
    ``network_s``
        One-way network latency router → engine, seconds.
    ``engine_type``
        Index into :attr:`type_names`.
    ``prefill_tokens_per_step``
        Other requests' prefill tokens expected beside each decode step of a request
        decoding there (co-located chunked prefill;
        :attr:`fastroute.predict.interleave.PrefillInterleave.expected`); 0 on a
        decode-only engine or if unknown.

    Beside the matrix, ``prefix_hit_rate`` (one float per engine, row order) is the engine's
    own prefix-cache hit rate over the last minute of scrapes
    (:mod:`fastroute.signals.prefix_cache`), NaN when unknown or without traffic. No policy
    decision reads it yet.

    Parameters
    ----------
    n_engines : int
    type_names : sequence of str
        Engine type names (calibration keys, e.g. ``"a40"``); the ``engine_type``
        column indexes it. Default: every engine is ``"a40"``.
    """

    __slots__ = ("values", "type_names", "prefix_hit_rate")

    def __init__(self, n_engines: int, type_names: Sequence[str] = (DEFAULT_TYPE,)) -> None:
        if n_engines < 0 or not type_names:
            raise ValueError("n_engines must be >= 0 and type_names non-empty")
        self.values = np.zeros((n_engines, len(COLUMNS)))
        self.values[:, StateColumn.RUNNING_REMAINING_TOKENS] = np.nan
        self.type_names = tuple(type_names)
        self.prefix_hit_rate = np.full(n_engines, np.nan)

    def column(self, name: str | StateColumn) -> np.ndarray:
        """A writable view of column ``name`` (one value per engine)."""
        if isinstance(name, StateColumn):
            return self.values[:, name]
        try:
            return self.values[:, _COL[name]]
        except KeyError:
            raise KeyError(f"unknown column {name!r}; columns: {', '.join(COLUMNS)}") from None


@runtime_checkable
class EngineStateView(FleetView, Protocol):
    """A :class:`FleetView` that also exposes per-engine load (what ``marginal-cost`` reads).

    Both the proxy (from engine ``/metrics`` scrapes and its own in-flight bookkeeping)
    and the simulator (exactly) can implement it; any :class:`FleetView` without it
    still works, with degraded information (see the module docstring).
    """

    def engine_state(self) -> EngineState:
        """The current :class:`EngineState` (same object may be returned each time; the
        policy only reads it during one decision)."""
        ...

    def cached_prefix_tokens(self, request: RouteRequest) -> np.ndarray | None:
        """Prompt tokens of ``request`` already cached on each engine (shape
        ``(n_engines,)``), or ``None`` if unknown (the policy then uses its own prefix
        tree)."""
        ...


class StaticEngineStateView(StaticFleetView):
    """A concrete :class:`EngineStateView` over plain arrays (simulator and tests).

    Parameters are those of :class:`StaticFleetView`, plus ``type_names`` for the
    :class:`EngineState`.

    Attributes
    ----------
    state : EngineState
        Updated in place by the owner.
    prefix_hits : ndarray or None
        Cached prompt tokens per engine for the *next* decision, if the owner knows
        them (set before ``choose``); ``None`` lets the policy use its prefix tree.
    """

    def __init__(
        self,
        engine_ids: Sequence[int] | np.ndarray,
        weights: Any,
        available: Any = None,
        *,
        selector: Any = None,
        type_names: Sequence[str] = (DEFAULT_TYPE,),
    ) -> None:
        super().__init__(engine_ids, weights, available, selector=selector)
        self.state = EngineState(self.n_engines, type_names)
        self.prefix_hits: np.ndarray | None = None

    def engine_state(self) -> EngineState:
        return self.state

    def cached_prefix_tokens(self, request: RouteRequest) -> np.ndarray | None:
        return self.prefix_hits


class MarginalRequest(RouteRequest, frozen=True, gc=False):
    """A :class:`RouteRequest` with the fields ``marginal-cost`` reads when present.

    Attributes
    ----------
    tenant : str or None
        Tenant key of the output-length histograms.
    slo_ttft_s, slo_tpot_s : float or None
        Per-request SLOs (from request headers), seconds; ``None`` = the policy's class
        default.
    """

    tenant: str | None = None
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None


class MarginalDecision(Decision, frozen=True, gc=False):
    """A :class:`Decision` with the chosen engine's predictions (for the decision record).

    Attributes
    ----------
    ttft_s, tpot_s : float
        Predicted time to first token and per output token on ``ranked[0]`` (on the
        best candidate when the request is rejected), seconds.
    output_tokens : float
        Output length the costs assumed (``cached_tokens``, the base's field, is the
        prompt tokens the costs assumed cached on ``ranked[0]``).
    detail : str
        Human-readable reason of a rejection (empty otherwise).
    """

    ttft_s: float = 0.0
    tpot_s: float = 0.0
    output_tokens: float = 0.0
    detail: str = ""


class PairDecision(msgspec.Struct, frozen=True, gc=False):
    """The outcome of :meth:`MarginalCost.choose_pair` for a disaggregated class.

    Attributes
    ----------
    prefill, decode : Decision
        Rankings over each pool (first = chosen; both empty when rejected or when a pool
        has no eligible engine).
    reason : str
        ``"marginal"``, ``"near-tie-p2c"``, ``"slo-spill"``, ``"kv-full"``,
        ``"slo-infeasible"``, ``"slo-probe"``, ``"slo-deprioritised"``,
        ``"slo-miss-least-cost"`` or ``"no-eligible-engine"``.
    ttft_s, tpot_s, transfer_s, cost_s : float
        Predictions for the chosen pair: client TTFT (prefill + transfer + first decode
        step), TPOT, KV transfer time, marginal cost.
    output_tokens : float
        Output length assumed.
    detail : str
        Reason of a rejection.
    """

    prefill: Decision
    decode: Decision
    reason: str
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    transfer_s: float = 0.0
    cost_s: float = 0.0
    output_tokens: float = 0.0
    detail: str = ""

    @property
    def chosen(self) -> tuple[int, int] | None:
        """(prefill index, decode index), or ``None`` if rejected."""
        if self.prefill.ranked and self.decode.ranked:
            return self.prefill.ranked[0], self.decode.ranked[0]
        return None


class MarginalPairs:
    """The proxy's P/D pair-selector seam (:class:`fastroute.policy.pairs.PairSelector`) over
    :meth:`MarginalCost.choose_pair`.

    The proxy passes the request once per pool (with that pool's class row) and gets
    ``(prefill decision, decode decision)``. A rejection comes back as two empty
    rankings whose ``reason`` is :data:`REASON_SLO_INFEASIBLE` (the prefill decision is a
    :class:`MarginalDecision` whose ``detail`` says why): answer 429, not 503.

    Parameters
    ----------
    policy : MarginalCost
        Shared with whatever feeds its calibration and output lengths.
    """

    def __init__(self, policy: MarginalCost) -> None:
        self.policy = policy
        self.last: PairDecision | None = None  # for the decision record

    def choose_pair(
        self,
        prefill_request: RouteRequest,
        decode_request: RouteRequest,
        prefill: FleetView,
        decode: FleetView,
        k: int,
    ) -> tuple[Decision, Decision]:
        pair = self.policy.choose_pair(
            prefill_request,
            prefill,
            decode,
            prefill_row=prefill_request.row,
            decode_row=decode_request.row,
            k=k,
        )
        self.last = pair
        if pair.reason == REASON_SLO_INFEASIBLE:
            rejected = MarginalDecision(
                (),
                (),
                self.policy.name,
                REASON_SLO_INFEASIBLE,
                ttft_s=pair.ttft_s,
                tpot_s=pair.tpot_s,
                output_tokens=pair.output_tokens,
                detail=pair.detail,
            )
            return rejected, pair.decode
        return pair.prefill, pair.decode


# Positions in _Eval, for the hot path (a subscript is cheaper than the named property).
_ENGINE, _MC, _TTFT, _TPOT, _FEASIBLE, _CACHED = range(6)


class _Eval(tuple):
    """Scalar predictions of one candidate: ``(engine, mc, ttft, tpot, feasible, cached,
    ext, first_step, wait)`` (``wait``: network + queue wait before its prefill starts). A
    tuple subclass because one is built per candidate per decision
    and a tuple is about twice as cheap to build as a slotted object."""

    __slots__ = ()

    engine = property(itemgetter(0))
    mc = property(itemgetter(1))
    ttft = property(itemgetter(2))
    tpot = property(itemgetter(3))
    feasible = property(itemgetter(4))
    cached = property(itemgetter(5))
    ext = property(itemgetter(6))
    first_step = property(itemgetter(7))
    wait = property(itemgetter(8))


class MarginalCost(Policy):
    """Calibrated marginal completion time over the top-k rendezvous candidates.

    Parameters
    ----------
    candidates : int
        Rendezvous candidates evaluated per request (k of the top-k); 3.
    slo_ttft_s, slo_tpot_s : float or None
        Class-default SLOs, seconds; ``None`` = none.
    near_tie : float
        Relative MC band of the power-of-two guard; 0.05.
    infeasible : {"reject", "deprioritise"}
        Reject a request predicted to miss its SLO everywhere, or route it behind the
        longest predicted wait (see the module docstring).
    engine_type : str
        Calibration type of engines the view does not type; ``"a40"``.
    calibrate : bool
        Calibrate online (True) or keep nominal constants (False).
    bytes_per_token : float
        Prompt bytes per token, for truncated prefixes; 4.0.
    max_prefix_bytes, max_tree_size : int
        Prefix bytes matched, and remembered per engine (as ``cache-aware``).
    seed : int or None
        Seed of the near-tie sampling; ``None`` seeds from the OS.
    rng : random.Random or None
        Injected generator (takes precedence over ``seed``).
    calibration : FleetCalibration or None
        Shared calibration; a fresh one (``calibrate``, ``engine_type``) otherwise.
    output_lengths : OutputLengthPredictor or None
        Shared output-length predictor; a fresh one otherwise.
    probe_rate : float
        Fraction of predicted-infeasible requests routed anyway; 0.05.
    reject_window : int
        Requests the reject bound measures over; 100.
    """

    name: ClassVar[str] = "marginal-cost"
    needs_prefix: ClassVar[bool] = True

    def __init__(
        self,
        *,
        candidates: int = 3,
        slo_ttft_s: float | None = None,
        slo_tpot_s: float | None = None,
        near_tie: float = 0.05,
        infeasible: str = "reject",
        engine_type: str = DEFAULT_TYPE,
        calibrate: bool = True,
        bytes_per_token: float = 4.0,
        max_prefix_bytes: int = 16384,
        max_tree_size: int = 2**22,
        seed: int | None = None,
        rng: random.Random | None = None,
        calibration: FleetCalibration | None = None,
        output_lengths: OutputLengthPredictor | None = None,
        probe_rate: float = DEFAULT_PROBE_RATE,
        reject_window: int = DEFAULT_REJECT_WINDOW,
    ) -> None:
        if candidates < 1:
            raise PolicyConfigError(f"marginal-cost: candidates must be >= 1, got {candidates}")
        for label, slo in (("slo_ttft_s", slo_ttft_s), ("slo_tpot_s", slo_tpot_s)):
            if slo is not None and not slo > 0:
                raise PolicyConfigError(f"marginal-cost: {label} must be > 0 or None, got {slo}")
        if not near_tie >= 0:
            raise PolicyConfigError(f"marginal-cost: near_tie must be >= 0, got {near_tie}")
        if infeasible not in ("reject", "deprioritise"):
            raise PolicyConfigError(
                f"marginal-cost: infeasible must be 'reject' or 'deprioritise', got {infeasible!r}"
            )
        if not bytes_per_token > 0:
            raise PolicyConfigError(
                f"marginal-cost: bytes_per_token must be > 0, got {bytes_per_token}"
            )
        if max_prefix_bytes < 1 or max_tree_size < 1:
            raise PolicyConfigError(
                "marginal-cost: max_prefix_bytes and max_tree_size must be >= 1, got "
                f"{max_prefix_bytes} and {max_tree_size}"
            )
        try:
            self.calibration = calibration or FleetCalibration(
                default_type=engine_type, calibrate=calibrate
            )
        except ValueError as e:
            raise PolicyConfigError(f"marginal-cost: {e}") from None
        self.candidates = int(candidates)
        self.slo_ttft_s = slo_ttft_s
        self.slo_tpot_s = slo_tpot_s
        self.near_tie = float(near_tie)
        self.infeasible = infeasible
        self.engine_type = engine_type
        self.calibrate = bool(calibrate)
        self.bytes_per_token = float(bytes_per_token)
        self.max_prefix_bytes = int(max_prefix_bytes)
        self.max_tree_size = int(max_tree_size)
        self._seed = seed
        self.rng = rng if rng is not None else random.Random(seed)
        try:
            RejectBound(probe_rate, reject_window)  # validates the tunables
        except ValueError as e:
            raise PolicyConfigError(f"marginal-cost: {e}") from None
        self.probe_rate = float(probe_rate)
        self.reject_window = int(reject_window)
        # One reject bound per SLO: outcomes against one objective say nothing about
        # whether another is feasible (a 1 ms TTFT is not, whatever a 2 s one measures).
        self._reject_bounds: dict[tuple[float | None, float | None], RejectBound] = {}
        self.output_lengths = output_lengths or OutputLengthPredictor()
        self.tree = PrefixTree(self.max_tree_size)
        # Step-time models by the views' type-name tuples (two pools may type differently).
        self._models_by_types: dict[tuple[str, ...], list[StepTimeModel]] = {}
        self._id_cache: dict[int, tuple[Any, list[int]]] = {}
        self._mean_out = -1.0
        self._tokens_per_byte = 0.25  # set per decision by _cached

    # -- public API ------------------------------------------------------------------------

    def choose(self, request: RouteRequest, view: FleetView, k: int = DEFAULT_K) -> Decision:
        check_k(k)
        mask = view.eligible(request.row)
        cands = view.selector.rank(request.key_hash, request.row, max(k, self.candidates), mask)
        if not cands:
            return self._empty()
        ids = self._ids(view)
        state = self._state(view)
        n, n_out = self._sizes(request)
        cached = self._cached(request, view, n, ids)
        slo_ttft, slo_tpot = self._slos(request)
        loads = view.in_flight() if state is None else None
        evals = [
            self._evaluate(e, ids[e], n, n_out, cached, state, loads, slo_ttft, slo_tpot)
            for e in cands
        ]
        head = evals[: self.candidates]
        feasible = [ev for ev in head if ev[_FEASIBLE]]
        reason = "marginal"
        has_slo = slo_ttft is not None or slo_tpot is not None
        judged = False  # the reject bound was asked (it counted this decision)
        if not feasible:
            if has_slo:
                spill = self._spill(
                    mask, cands, ids, n, n_out, cached, state, loads, slo_ttft, slo_tpot
                )
                if spill is not None:
                    evals = [spill, *(ev for ev in evals if ev.engine != spill.engine)]
                    feasible = [spill]
                    reason = "slo-spill"
                elif self.infeasible == "reject":
                    verdict = self._bound(slo_ttft, slo_tpot).verdict()
                    judged = True
                    if verdict is Verdict.REJECT:
                        best = min(head, key=_mc)
                        return self._reject(view, best, n_out, slo_ttft, slo_tpot, len(evals))
                    feasible, reason = head, REASON_SLO_PROBE
                else:
                    feasible, reason = self._deprioritise(head, slo_ttft)
            else:
                feasible = head
                reason = "kv-full"
        if has_slo and not judged:
            self._bound(slo_ttft, slo_tpot).admitted()
        chosen = min(feasible, key=_mc)
        if self.near_tie > 0 and len(feasible) > 1 and reason == "marginal":
            chosen, tied = self._near_tie(view, feasible, chosen)
            if tied:
                reason = "near-tie-p2c"
        if len(evals) > 1:
            evals.remove(chosen)
            evals.sort(key=_rank_key)
            evals.insert(0, chosen)
            del evals[k:]
        ranked = tuple([ev[_ENGINE] for ev in evals])
        # Positional (field order of Decision, then MarginalDecision): the hot path.
        return MarginalDecision(
            ranked,
            tuple([ids[e] for e in ranked]),
            self.name,
            reason,
            tuple([ev[_MC] for ev in evals]),
            chosen[_CACHED],
            chosen[_TTFT],
            chosen[_TPOT],
            n_out,
        )

    def choose_pair(
        self,
        request: RouteRequest,
        prefill_view: FleetView,
        decode_view: FleetView,
        *,
        prefill_row: int | None = None,
        decode_row: int | None = None,
        k: int = DEFAULT_K,
    ) -> PairDecision:
        """Choose a (prefill, decode) pair for a disaggregated class.

        Parameters
        ----------
        request : RouteRequest
        prefill_view, decode_view : FleetView
            The two pools (the same view with two rows is fine).
        prefill_row, decode_row : int, optional
            Class rows of each pool; ``request.row`` by default.
        k : int
            Length of each failover ranking.

        Returns
        -------
        PairDecision
            Empty rankings with reason ``"slo-infeasible"`` when no evaluated pair is
            predicted to meet the SLOs, ``"no-eligible-engine"`` when a pool is empty.
        """
        check_k(k)
        prow = request.row if prefill_row is None else prefill_row
        drow = request.row if decode_row is None else decode_row
        pmask, dmask = prefill_view.eligible(prow), decode_view.eligible(drow)
        kk = max(k, self.candidates)
        pc = prefill_view.selector.rank(request.key_hash, prow, kk, pmask)
        dc = decode_view.selector.rank(request.key_hash, drow, kk, dmask)
        if not pc or not dc:
            empty = Decision((), (), self.name, "no-eligible-engine")
            return PairDecision(empty, empty, "no-eligible-engine")
        pids, dids = self._ids(prefill_view), self._ids(decode_view)
        pstate, dstate = self._state(prefill_view), self._state(decode_view)
        ploads = prefill_view.in_flight() if pstate is None else None
        dloads = decode_view.in_flight() if dstate is None else None
        n, n_out = self._sizes(request)
        pcached = self._cached(request, prefill_view, n, pids)
        dcached = self._cached(request, decode_view, n, dids)
        slo_ttft, slo_tpot = self._slos(request)
        pev = [self._evaluate(p, pids[p], n, 1.0, pcached, pstate, ploads, None, None) for p in pc]
        dev = [self._evaluate_decode(d, dids[d], n, n_out, dcached, dstate, dloads) for d in dc]
        transfer = self.calibration.transfer
        pairs: list[tuple[float, float, float, bool, _Eval, _Eval]] = []
        for pe in pev[: self.candidates]:
            for de in dev[: self.candidates]:
                tx = transfer.predict_s(max(1, n - 1 - de.cached))
                ttft = pe.ttft + tx + de.first_step
                cost = pe.ttft + pe.ext + tx + de.mc
                ok = pe.feasible and de.feasible
                if slo_ttft is not None and ttft > slo_ttft:
                    ok = False
                if slo_tpot is not None and de.tpot > slo_tpot:
                    ok = False
                pairs.append((cost, ttft, tx, ok, pe, de))
        feasible = [p for p in pairs if p[3]]
        reason = "marginal"
        has_slo = slo_ttft is not None or slo_tpot is not None
        if not feasible and has_slo and self.infeasible == "deprioritise":
            sink, reason = self._deprioritise([p[4] for p in pairs], slo_ttft)
            if reason == REASON_SLO_DEPRIORITISED:
                feasible = [p for p in pairs if p[4] is sink[0]]
            else:
                feasible = pairs
        elif not feasible and has_slo:
            if self._bound(slo_ttft, slo_tpot).verdict() is not Verdict.REJECT:
                feasible, reason = pairs, REASON_SLO_PROBE  # admitted anyway: least cost
        elif has_slo:
            self._bound(slo_ttft, slo_tpot).admitted()
        if not feasible:
            best = min(pairs, key=lambda p: p[0])
            if slo_ttft is not None or slo_tpot is not None:
                detail = (
                    f"best pair of {len(pairs)}: predicted TTFT {best[1]:.3f} s "
                    f"(SLO {_fmt(slo_ttft)}), TPOT {best[5].tpot:.4f} s (SLO {_fmt(slo_tpot)})"
                )
                empty = Decision((), (), self.name, REASON_SLO_INFEASIBLE)
                return PairDecision(
                    empty,
                    empty,
                    REASON_SLO_INFEASIBLE,
                    ttft_s=best[1],
                    tpot_s=best[5].tpot,
                    transfer_s=best[2],
                    cost_s=best[0],
                    output_tokens=n_out,
                    detail=detail,
                )
            feasible, reason = pairs, "kv-full"
        chosen = min(feasible, key=lambda p: p[0])
        if self.near_tie > 0 and reason == "marginal" and len(feasible) > 1:
            band = chosen[0] * (1.0 + self.near_tie)
            ties = [p for p in feasible if p[0] <= band]
            if len(ties) > 1:
                a, b = _two(self.rng, ties)
                pl, dl = prefill_view.in_flight(), decode_view.in_flight()
                la = int(pl[a[4].engine]) + int(dl[a[5].engine])
                lb = int(pl[b[4].engine]) + int(dl[b[5].engine])
                pick = a if (la, a[0]) <= (lb, b[0]) else b
                if pick is not chosen:
                    reason = "near-tie-p2c"
                chosen = pick
        pe_c, de_c = chosen[4], chosen[5]
        p_rest = sorted((e for e in pev if e is not pe_c), key=_rank_key)
        d_rest = sorted((e for e in dev if e is not de_c), key=_rank_key)
        p_rank, d_rank = [pe_c, *p_rest][:k], [de_c, *d_rest][:k]
        return PairDecision(
            prefill=self._ranked_decision(pids, p_rank, reason),
            decode=self._ranked_decision(dids, d_rank, reason),
            reason=reason,
            ttft_s=chosen[1],
            tpot_s=de_c.tpot,
            transfer_s=chosen[2],
            cost_s=chosen[0],
            output_tokens=n_out,
        )

    def on_routed(self, request: RouteRequest, engine_id: int) -> None:
        """Insert the request's prefix into ``engine_id``'s tree (its KV cache will hold it)."""
        if request.prefix:
            self.tree.insert(request.prefix[: self.max_prefix_bytes], engine_id)

    def observe_output(self, request: RouteRequest, output_tokens: int, now_s: float) -> None:
        """A request of ``request``'s class (and tenant) finished with ``output_tokens``."""
        self.output_lengths.observe(
            output_tokens, now_s, tenant=getattr(request, "tenant", None), cls=request.row
        )

    def observe_outcome(
        self, request: RouteRequest, ttft_s: float | None, tpot_s: float | None
    ) -> None:
        """An admitted request finished with realised ``ttft_s`` and ``tpot_s`` (seconds;
        ``None`` = not measured): whether it met its SLOs feeds the reject bound
        (:class:`~fastroute.predict.reject_bound.RejectBound`). Requests without an SLO
        are not counted."""
        slo_ttft, slo_tpot = self._slos(request)
        if slo_ttft is None and slo_tpot is None:
            return
        missed = (ttft_s is not None and slo_ttft is not None and ttft_s > slo_ttft) or (
            tpot_s is not None and slo_tpot is not None and tpot_s > slo_tpot
        )
        self._bound(slo_ttft, slo_tpot).observe(missed)

    def reject_bound(self, request: RouteRequest) -> RejectBound:
        """The :class:`~fastroute.predict.reject_bound.RejectBound` of ``request``'s SLOs
        (per-request, else the class defaults); requests with equal SLOs share one."""
        return self._bound(*self._slos(request))

    def _bound(self, slo_ttft: float | None, slo_tpot: float | None) -> RejectBound:
        key = (slo_ttft, slo_tpot)
        bound = self._reject_bounds.get(key)
        if bound is None:
            if len(self._reject_bounds) >= MAX_REJECT_BOUNDS:
                # Header SLOs are free-form: forget the oldest objective's evidence.
                del self._reject_bounds[next(iter(self._reject_bounds))]
            bound = self._reject_bounds[key] = RejectBound(self.probe_rate, self.reject_window)
        return bound

    def calibration_state(self) -> dict[str, Any]:
        """Calibration as plain data (coefficients, sample counts, errors) for /metrics."""
        return self.calibration.to_dict()

    def reset(self) -> None:
        """Forget routed prefixes and reseed the sampler (calibration is kept: it is shared)."""
        self.tree.clear()
        self._id_cache.clear()
        if self._seed is not None:
            self.rng.seed(self._seed)

    def __repr__(self) -> str:
        return (
            f"<MarginalCost candidates={self.candidates} slo_ttft_s={self.slo_ttft_s} "
            f"slo_tpot_s={self.slo_tpot_s} near_tie={self.near_tie} infeasible={self.infeasible} "
            f"calibrate={self.calibrate}>"
        )

    # -- inputs ----------------------------------------------------------------------------

    def _ids(self, view: FleetView) -> list[int]:
        sel = view.selector
        hit = self._id_cache.get(id(sel))
        if hit is not None and hit[0] is sel:
            return hit[1]
        if len(self._id_cache) >= 4:
            self._id_cache.clear()
        ids = [int(x) for x in sel.engine_ids]
        self._id_cache[id(sel)] = (sel, ids)  # holds sel, so its id() is not reused
        return ids

    def _state(self, view: FleetView) -> EngineState | None:
        getter = getattr(view, "engine_state", None)
        if getter is None:
            return None
        state = getter()
        names = state.type_names
        if names not in self._models_by_types:
            if len(self._models_by_types) >= 8:
                self._models_by_types.clear()
            self._models_by_types[names] = [self.calibration.model(t) for t in names]
        return state

    def _sizes(self, request: RouteRequest) -> tuple[int, float]:
        n = request.prompt_tokens
        if n <= 0:
            n = max(1, int(len(request.prefix) / self.bytes_per_token))
        self._mean_out = -1.0  # E[N] overall, read lazily (see _typical_remaining)
        n_out = request.expected_output_tokens
        if n_out is None:
            n_out = self.output_lengths.mean(getattr(request, "tenant", None), request.row)
        return n, max(1.0, float(n_out))

    def _slos(self, request: RouteRequest) -> tuple[float | None, float | None]:
        ttft = getattr(request, "slo_ttft_s", None)
        tpot = getattr(request, "slo_tpot_s", None)
        return (
            self.slo_ttft_s if ttft is None else ttft,
            self.slo_tpot_s if tpot is None else tpot,
        )

    def _cached(self, request: RouteRequest, view: FleetView, n: int, ids: list[int]) -> Any:
        """Cached prompt tokens: an array of tokens by index (view), or a dict of matched
        bytes by engine id (tree; times ``_tokens_per_byte``), or ``None``."""
        hits = getattr(view, "cached_prefix_tokens", None)
        if hits is not None:
            arr = hits(request)
            if arr is not None:
                return arr
        prefix = request.prefix[: self.max_prefix_bytes]
        if not prefix:
            return None
        matched = self.tree.match(prefix)
        if not matched:
            return None
        size = len(prefix)
        if size < self.max_prefix_bytes:
            self._tokens_per_byte = n / size  # the prefix is the whole prompt text
        else:
            self._tokens_per_byte = min(n / size, 1.0 / self.bytes_per_token)
        return matched  # bytes by engine id; scaled per candidate (most are never read)

    # -- the model -------------------------------------------------------------------------

    def _load(
        self, e: int, state: EngineState | None, loads: np.ndarray | None, n: int, n_out: float
    ) -> tuple[list[float], StepTimeModel]:
        if state is not None:
            row = state.values[e].tolist()
            return row, self._models_by_types[state.type_names][int(row[_ENGINE_TYPE])]
        b = float(loads[e]) if loads is not None else 0.0
        # No state: in-flight requests as the running batch, of this request's size
        # (a row in StateColumn order).
        row = [0.0, 0.0, b, b * (n + n_out / 2), math.nan, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
        return row, self.calibration.model(self.engine_type)

    def _evaluate(
        self,
        e: int,
        engine_id: int,
        n: int,
        n_out: float,
        cached: Any,
        state: EngineState | None,
        loads: np.ndarray | None,
        slo_ttft: float | None,
        slo_tpot: float | None,
    ) -> _Eval:
        """Predictions of serving the request (prefill and decode) on engine ``e``.

        The hot path of the policy (k calls per decision): Python floats only, no
        helper calls in the common case.
        """
        if state is not None:
            row = state.values[e].tolist()  # unpacked in StateColumn order
            q_tok, q_req, B, S, rem, kv_used, kv_cap, lam, net, typ, mix = row
            m = self._models_by_types[state.type_names][int(typ)]
        else:
            row, m = self._load(e, state, loads, n, n_out)
            q_tok, q_req, B, S, rem, kv_used, kv_cap, lam, net, _, mix = row
        a0, b0, b1, b2, a1, a2, a3, m1 = m.rls.coef
        r, rd = m.residuals(engine_id)
        budget = m.budget
        c = 0
        if cached is not None:
            if type(cached) is dict:
                c = int(cached.get(engine_id, 0) * self._tokens_per_byte)
            else:
                c = int(cached[e])
            c = 0 if c < 0 else (n - 1 if c >= n else c)
        u = n - c
        base = (b0 + b1 * B + b2 * S) if B > 0 else a0
        wq = 0.0
        if q_tok > 0:
            wq = -(-int(q_tok) // budget) * base + a1 * q_tok + a2 * q_tok * min(q_tok, budget)
        if u <= budget:  # one chunk: the common case, without the closed form
            compute = u * (a1 + a2 * u + a3 * c)
            pf = r * (base + compute)
        else:
            steps, sq, nc = chunk_sums(u, c, budget)
            compute = a1 * u + a2 * sq + a3 * nc
            pf = r * (steps * base + compute)
        ttft = net + r * wq + pf
        half = n + n_out * 0.5
        tpot = rd * (b0 + b1 * (B + q_req + 1) + b2 * (S + q_tok + half) + m1 * mix)
        ext = 0.0
        if B > 0:
            overlap = (
                (B * n_out if B * n_out < rem else rem)
                if rem == rem
                else B * min(n_out, self._typical_remaining())
            )
            ext = rd * (B * m1 * u + (b1 + b2 * half) * (overlap + q_req * n_out))
        elif q_req > 0:
            ext = rd * (b1 + b2 * half) * q_req * n_out
        if lam > 0:
            rho = lam * pf
            ext += lam * pf * pf / (2.0 * (1.0 - (rho if rho < 0.9 else 0.9)))
        ok = kv_cap <= 0 or kv_used + q_tok + u + n_out <= kv_cap
        if slo_ttft is not None and ttft > slo_ttft:
            ok = False
        if slo_tpot is not None and tpot > slo_tpot:
            ok = False
        return _Eval(
            (e, ttft + (n_out - 1) * tpot + ext, ttft, tpot, ok, c, ext, 0.0, net + r * wq)
        )

    def _evaluate_decode(
        self,
        d: int,
        engine_id: int,
        n: int,
        n_out: float,
        cached: Any,
        state: EngineState | None,
        loads: np.ndarray | None,
    ) -> _Eval:
        """Decode-side predictions: first step after the KV lands, TPOT, externality."""
        row, m = self._load(d, state, loads, n, n_out)
        q_tok, q_req, B, S, rem, kv_used, kv_cap, _lam, _net, _, mix = row
        _a0, b0, b1, b2, _a1, _a2, _a3, m1 = m.rls.coef
        r = m.residual(engine_id, "decode")
        c = 0
        if cached is not None:
            if type(cached) is dict:
                c = int(cached.get(engine_id, 0) * self._tokens_per_byte)
            else:
                c = int(cached[d])
            c = min(max(c, 0), n - 1)
        first = r * (b0 + b1 * (B + 1) + b2 * (S + n))
        half = n + n_out * 0.5
        tpot = r * (b0 + b1 * (B + q_req + 1) + b2 * (S + q_tok + half) + m1 * mix)
        if B > 0:
            overlap = (
                min(B * n_out, rem) if rem == rem else B * min(n_out, self._typical_remaining())
            )
        else:
            overlap = 0.0
        ext = r * (b1 + b2 * half) * (overlap + q_req * n_out)
        ok = kv_cap <= 0 or kv_used + q_tok + n + n_out <= kv_cap
        return _Eval((d, first + (n_out - 1) * tpot + ext, first, tpot, ok, c, ext, first, 0.0))

    def _typical_remaining(self) -> float:
        """E[N] over all traffic: the remaining length assumed for a running request when
        the engine state does not carry ``running_remaining_tokens`` (once per decision)."""
        if self._mean_out < 0:
            self._mean_out = self.output_lengths.mean()
        return self._mean_out

    # -- decisions -------------------------------------------------------------------------

    def _spill(
        self,
        mask: np.ndarray,
        cands: list[int],
        ids: list[int],
        n: int,
        n_out: float,
        cached: Any,
        state: EngineState | None,
        loads: np.ndarray | None,
        slo_ttft: float | None,
        slo_tpot: float | None,
    ) -> _Eval | None:
        """Best feasible engine outside the candidates (all eligible ones; rare path)."""
        seen = set(cands[: self.candidates])
        best: _Eval | None = None
        for e in np.flatnonzero(mask).tolist():
            if e in seen:
                continue
            ev = self._evaluate(e, ids[e], n, n_out, cached, state, loads, slo_ttft, slo_tpot)
            if ev.feasible and (best is None or ev.mc < best.mc):
                best = ev
        return best

    def _deprioritise(self, evals: list[_Eval], slo_ttft: float | None) -> tuple[list[_Eval], str]:
        """Where a request predicted to miss its SLO everywhere goes (``infeasible =
        "deprioritise"``): behind the longest predicted wait among candidates whose wait
        alone already exceeds the TTFT SLO (requests routed there miss anyway), else, if
        the request misses only through its own size, by least MC like any other: an
        engine that is not already overloaded is never made a sink, so an idle engine
        keeps receiving work whatever the model predicts (work conservation)."""
        if slo_ttft is not None:
            over = [ev for ev in evals if ev.wait > slo_ttft]
            if over:
                return [max(over, key=_wait)], REASON_SLO_DEPRIORITISED
        return evals, "slo-miss-least-cost"

    def _near_tie(self, view: FleetView, feasible: list[_Eval], best: _Eval) -> tuple[_Eval, bool]:
        band = best[_MC] * (1.0 + self.near_tie)
        ties = [ev for ev in feasible if ev[_MC] <= band]
        if len(ties) < 2:
            return best, False
        a, b = _two(self.rng, ties)
        loads = view.in_flight()
        la, lb = int(loads[a[_ENGINE]]), int(loads[b[_ENGINE]])
        pick = a if (la, a[_MC]) <= (lb, b[_MC]) else b
        return pick, pick is not best

    def _reject(
        self,
        view: FleetView,
        best: _Eval,
        n_out: float,
        slo_ttft: float | None,
        slo_tpot: float | None,
        evaluated: int,
    ) -> MarginalDecision:
        detail = (
            f"no engine predicted to meet the SLO: best of {evaluated} candidates has "
            f"TTFT {best.ttft:.3f} s (SLO {_fmt(slo_ttft)}), TPOT {best.tpot:.4f} s "
            f"(SLO {_fmt(slo_tpot)})"
        )
        return MarginalDecision(
            ranked=(),
            engine_ids=(),
            policy=self.name,
            reason=REASON_SLO_INFEASIBLE,
            scores=None,
            ttft_s=best.ttft,
            tpot_s=best.tpot,
            output_tokens=n_out,
            cached_tokens=best.cached,
            detail=detail,
        )

    def _ranked_decision(self, ids: list[int], ranked: list[_Eval], reason: str) -> Decision:
        return MarginalDecision(
            ranked=tuple([ev.engine for ev in ranked]),
            engine_ids=tuple([ids[ev.engine] for ev in ranked]),
            policy=self.name,
            reason=reason,
            scores=tuple([ev.mc for ev in ranked]),
            ttft_s=ranked[0].ttft,
            tpot_s=ranked[0].tpot,
            cached_tokens=ranked[0].cached,
        )


def _two(rng: random.Random, items: list[Any]) -> tuple[Any, Any]:
    """Two distinct items uniformly at random (cheaper than ``rng.sample``)."""
    m = len(items)
    i = int(rng.random() * m)
    j = int(rng.random() * (m - 1))
    if j >= i:
        j += 1
    return items[i], items[j]


#: Sort keys over _Eval (C-level: they run several times per decision).
_mc = itemgetter(1)
_wait = itemgetter(8)


def _rank_key(ev: _Eval) -> tuple[bool, float]:
    return (not ev[_FEASIBLE], ev[_MC])


def _fmt(slo: float | None) -> str:
    return "none" if slo is None else f"{slo:.3f} s"
