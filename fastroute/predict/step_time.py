"""Calibrated step-time model of one engine type (docs/algorithms.md §6.3).

Functional form
    One linear model over eight **summed step features** covers prefill, decode,
    chunked-prefill-with-decodes steps and whole request phases, because every phase
    is a sum of steps and each step is linear in the coefficients::

        step time = (b0 if B else a0) + b1·B + b2·S + Σ_chunks (a1·n + a2·n² + a3·n·c)

    (B decoding sequences of total context S; prefill chunks of n new tokens over c
    already computed.) This is exactly the emulator's model
    (:mod:`fastroute.emulator.model`), so a fit to its timings can be exact. The
    features of a phase are the sums of its steps' features:

    ====  ===============  ===========================  ===========
    idx   feature          meaning                      coefficient
    ====  ===============  ===========================  ===========
    0     ``pf_steps``     steps with no decode         a0 (s)
    1     ``dec_steps``    steps with decodes           b0 (s)
    2     ``seq_steps``    Σ_steps B                    b1 (s/seq)
    3     ``ctx_steps``    Σ_steps S                    b2 (s/token)
    4     ``new``          Σ n                          a1 (s/token)
    5     ``new_sq``       Σ n²                         a2 (s/token²)
    6     ``new_cached``   Σ n·c                        a3 (s/token²)
    7     ``mix_new``      Σ interleaved prefill tokens m1 (s/token)
    ====  ===============  ===========================  ===========

    So a data plane that only sees request-level timings (TTFT = queueing + chunked
    prefill; TBOT = one decode step) feeds the same fit as a simulator that sees every
    step: :func:`prefill_features` and :func:`decode_features` build the feature sums.

Mixed (co-located chunked prefill) steps at request level
    A request's mean time between output tokens on a co-located engine is a mean over
    *mixed* steps: ``T = b0 + b1·B + b2·S + a1'·p`` where ``p`` is the mean number of
    other requests' prefill tokens run beside each of its decode steps
    (docs/algorithms.md §6.3, "Mixed step"). A data plane cannot see the chunks, but it can
    count the uncached prompt tokens it dispatched to the engine during the request's
    decode lifetime (:class:`~fastroute.predict.interleave.PrefillInterleave`). Feature 7
    carries that count and ``m1`` (``a1'``) is its coefficient, fitted with the decode
    block: without it, b0/b1/b2 absorb the interference (an unbiased fit to a biased
    form: b0 too high, b1 → 0). ``m1`` is separate from ``a1`` because it is an average
    over chunks (``a1 + a2·n + a3·c`` per token for the chunk sizes that occur), not
    the GEMM term alone; it starts at the nominal ``a1``. Exact steps
    (:func:`step_features`) keep using a1..a3.

Calibration
    Per engine **type**: :class:`~fastroute.predict.rls.RobustRLS` (λ = 0.995, Huber),
    starting from the type's nominal constants. A ``"prefill"`` observation updates only
    the prefill coefficients (a0..a3; its decode part is a known offset), a
    ``"decode"`` one only b0..b2 and m1, so an approximate TTFT cannot corrupt the TPOT model.
    Per **engine**: a multiplicative residual ``r_e`` (an EWMA of ``log(y / ŷ_type)``,
    clipped), so one slow GPU does not drag its type's coefficients; the type fit sees
    ``y / r_e``. The log residuals are
    centred on their mean over the type's engines: a common factor belongs to the type
    fit (with one engine ``r_e`` stays 1), otherwise the two estimates would trade the
    same factor back and forth and the type-level prediction would wander. There is one
    residual per engine **and kind**: request-level TTFT features are approximations
    (queueing, changing batches), and a prefill-side mismatch must not leak into the
    decode predictions through a shared factor. Per observation
    **kind** (``"prefill"``, ``"decode"``): a split-conformal p90 factor on
    ``y / (r_e · ŷ_type)``, computed before each update (out of sample).

    With ``calibrate=False`` observations are ignored: the model keeps its nominal
    constants (the "uncalibrated" baseline of the issue's experiments).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgspec

from fastroute.predict.conformal import ConformalBound
from fastroute.predict.rls import RobustRLS

__all__ = [
    "COEF_NAMES",
    "KINDS",
    "NominalStepTimes",
    "StepTimeModel",
    "StepModelState",
    "prefill_features",
    "decode_features",
    "step_features",
    "queue_features",
    "chunk_sums",
]

#: Coefficient names, in feature order (see the module docstring).
COEF_NAMES = ("a0_s", "b0_s", "b1_s", "b2_s", "a1_s", "a2_s", "a3_s", "m1_s")
#: Observation kinds with their own conformal window.
KINDS = ("prefill", "decode")
# Conditioning only: typical magnitudes of the features are 1, 1, 1e2, 1e5, 1e3, 1e6, 1e6, 1e2.
_SCALE = (1.0, 1.0, 1e-2, 1e-5, 1e-3, 1e-6, 1e-6, 1e-2)
_RESIDUAL_CLIP = 0.7  # |log ratio| per sample: a ×2 spike moves r_e by at most α·0.7
_RESIDUAL_ALPHA = 0.02
_PREFILL_IDX = (0, 4, 5, 6)  # a0, a1, a2, a3
_DECODE_IDX = (1, 2, 3, 7)  # b0, b1, b2, m1


class NominalStepTimes(msgspec.Struct, frozen=True):
    """Nominal (uncalibrated) coefficients of an engine type, in seconds.

    Attributes
    ----------
    a0_s, a1_s, a2_s, a3_s : float
        Prefill: per step, per new token, per new token², per new × cached token.
    b0_s, b1_s, b2_s : float
        Decode: per step, per sequence, per context token.
    max_num_batched_tokens : int
        Token budget per step (chunk size of a long prefill).
    kv_capacity_tokens : int
        KV-cache capacity in tokens (0 = unknown).
    m1_s : float or None
        Decode-step time per interleaved prefill token (``a1'`` of a mixed step, see
        the module docstring); ``None``: ``a1_s``.
    """

    a0_s: float
    a1_s: float
    a2_s: float
    a3_s: float
    b0_s: float
    b1_s: float
    b2_s: float
    max_num_batched_tokens: int = 2048
    kv_capacity_tokens: int = 0
    m1_s: float | None = None

    @classmethod
    def from_profile(cls, profile: Any, *, max_num_batched_tokens: int | None = None) -> Any:
        """From a :class:`fastroute.hardware.HardwareProfile` (or any object with
        the same attributes)."""
        return cls(
            a0_s=profile.a0_s,
            a1_s=profile.a1_s,
            a2_s=profile.a2_s,
            a3_s=profile.a3_s,
            b0_s=profile.b0_s,
            b1_s=profile.b1_s,
            b2_s=profile.b2_s,
            max_num_batched_tokens=max_num_batched_tokens or profile.default_max_num_batched_tokens,
            kv_capacity_tokens=profile.kv_capacity_tokens,
        )

    def coef(self) -> list[float]:
        """Coefficients in feature order (``m1_s`` defaults to ``a1_s``)."""
        m1 = self.a1_s if self.m1_s is None else self.m1_s
        return [getattr(self, name) for name in COEF_NAMES[:-1]] + [m1]

    def scaled(self, factor: float) -> NominalStepTimes:
        """Every time coefficient multiplied by ``factor`` (a mis-specified nominal)."""
        return msgspec.structs.replace(
            self, **{name: c * factor for name, c in zip(COEF_NAMES, self.coef(), strict=True)}
        )


class StepModelState(msgspec.Struct):
    """Exported calibration of one engine type (plain data for /metrics, decision records
    and publication to new workers).

    Attributes
    ----------
    coef : dict of str to float
        Current coefficients by name (``a0_s`` ... ``m1_s``), seconds.
    n_samples : int
        Observations folded in.
    effective_samples : float
        Sum of Huber weights (outliers count less than 1).
    sigma_rel : float
        Robust relative scale of the residuals.
    abs_rel_err : float
        EWMA of the absolute relative error (out of sample).
    p90_factor : dict of str to float
        Conformal p90 factor per kind (``ŷ · factor`` bounds 90 % of observations).
    residuals : dict of str to dict of int to float
        Per kind, the per-engine multiplicative residual ``r_e`` by engine id.
    calibrate : bool
        False if observations are ignored (nominal constants).
    samples_by_kind : dict of str to int
        Observations folded in per kind (``prefill``, ``decode``).
    information : list of list of float
        The RLS information matrix in internal scaled units, so that a worker loading
        the state continues exactly where the publisher was; may be empty.
    """

    coef: dict[str, float]
    n_samples: int
    effective_samples: float
    sigma_rel: float
    abs_rel_err: float
    p90_factor: dict[str, float]
    residuals: dict[str, dict[int, float]]
    calibrate: bool = True
    information: list[list[float]] = []
    samples_by_kind: dict[str, int] = {}


# -- features ------------------------------------------------------------------------------


def chunk_sums(n: int, c: int, budget: int) -> tuple[int, float, float]:
    """Chunked prefill of ``n`` new tokens over ``c`` computed ones, ``budget`` per step.

    Returns
    -------
    steps, sum_sq, sum_cached : int, float, float
        Number of chunks, ``Σ n_i²`` and ``Σ n_i·c_i`` (``c_i = c + i·budget``), in
        closed form (O(1)).
    """
    if n <= 0:
        return 0, 0.0, 0.0
    full, rest = divmod(n, budget)
    sum_sq = float(full * budget * budget + rest * rest)
    # Σ_{i<full} budget·(c + i·budget) + rest·(c + full·budget)
    sum_cached = float(
        full * budget * c + budget * budget * full * (full - 1) // 2 + rest * (c + full * budget)
    )
    return full + (1 if rest else 0), sum_sq, sum_cached


def prefill_features(
    n: int, c: int = 0, *, batch: int = 0, context: int = 0, budget: int = 2048
) -> list[float]:
    """Features of prefilling ``n`` new tokens over ``c`` cached, in chunks of ``budget``,
    while ``batch`` sequences of total context ``context`` decode in the same steps."""
    steps, sq, nc = chunk_sums(n, c, budget)
    if batch > 0:
        return [0.0, steps, steps * batch, steps * context, n, sq, nc, 0.0]
    return [steps, 0.0, 0.0, 0.0, n, sq, nc, 0.0]


def queue_features(
    tokens: int, *, batch: int = 0, context: int = 0, budget: int = 2048
) -> list[float]:
    """Features of draining ``tokens`` of queued prompts (no cached prefix assumed, whole
    chunks of ``budget``): the wait before a new request's own prefill starts."""
    return prefill_features(tokens, 0, batch=batch, context=context, budget=budget)


def decode_features(batch: int, context: int, prefill_tokens: float = 0.0) -> list[float]:
    """Features of one decode step of ``batch`` sequences holding ``context`` tokens,
    beside ``prefill_tokens`` (mean) prefill tokens of other requests (co-located
    chunked prefill; 0 on a decode-only engine)."""
    return [0.0, 1.0, batch, context, 0.0, 0.0, 0.0, prefill_tokens]


def step_features(
    batch: int, context: int, new: int = 0, new_sq: float = 0.0, new_cached: float = 0.0
) -> list[float]:
    """Features of one scheduler step (what a simulator or the emulator knows exactly)."""
    if batch > 0:
        return [0.0, 1.0, batch, context, new, new_sq, new_cached, 0.0]
    return [1.0, 0.0, 0.0, 0.0, new, new_sq, new_cached, 0.0]


# -- the model -----------------------------------------------------------------------------


class _Residual:
    __slots__ = ("log_ratio", "count")

    def __init__(self) -> None:
        self.log_ratio = 0.0
        self.count = 0


class StepTimeModel:
    """Online-calibrated step-time model of one engine type.

    Parameters
    ----------
    nominal : NominalStepTimes
        Starting coefficients (and the fixed ones when ``calibrate`` is false).
    calibrate : bool
        Fold observations in (True) or keep the nominal constants (False).
    forgetting : float
        RLS forgetting factor λ.
    prior_rel : float
        Relative uncertainty of the nominal coefficients.
    window : int
        Conformal window (ratios per kind).
    max_engines : int
        Per-engine residuals kept (oldest forgotten beyond).

    Attributes
    ----------
    budget : int
        Token budget per step (chunk size).
    kv_capacity_tokens : int
        Nominal KV capacity per engine (0 = unknown).
    """

    def __init__(
        self,
        nominal: NominalStepTimes,
        *,
        calibrate: bool = True,
        forgetting: float = 0.995,
        prior_rel: float = 1.0,
        window: int = 512,
        max_engines: int = 4096,
    ) -> None:
        self.nominal = nominal
        self.calibrate = bool(calibrate)
        self.budget = int(nominal.max_num_batched_tokens)
        self.kv_capacity_tokens = int(nominal.kv_capacity_tokens)
        self.rls = RobustRLS(nominal.coef(), _SCALE, prior_rel=prior_rel, forgetting=forgetting)
        self.bounds = {kind: ConformalBound(0.9, window=window) for kind in KINDS}
        self.max_engines = int(max_engines)
        self._residuals: dict[str, dict[int, _Residual]] = {kind: {} for kind in KINDS}
        self._log_sum = dict.fromkeys(KINDS, 0.0)  # Σ log_ratio per kind (for centring)
        #: Observations folded in per kind (what /metrics reports as sample counts).
        self.samples_by_kind = dict.fromkeys(KINDS, 0)

    # -- prediction (hot path: Python floats only) -------------------------------------------

    def residual(self, engine_id: int | None, kind: str = "decode") -> float:
        """The engine's multiplicative residual ``r_e`` for ``kind`` (1.0 if unknown)."""
        if engine_id is None:
            return 1.0
        table = self._residuals[kind]
        res = table.get(engine_id)
        if res is None:
            return 1.0
        return math.exp(res.log_ratio - self._log_sum[kind] / len(table))

    def residuals(self, engine_id: int) -> tuple[float, float]:
        """The engine's ``(prefill, decode)`` residuals (one call on the policy's hot path)."""
        tables, sums = self._residuals, self._log_sum
        pf, dec = tables["prefill"], tables["decode"]
        r_pf = pf.get(engine_id)
        r_dec = dec.get(engine_id)
        return (
            1.0 if r_pf is None else math.exp(r_pf.log_ratio - sums["prefill"] / len(pf)),
            1.0 if r_dec is None else math.exp(r_dec.log_ratio - sums["decode"] / len(dec)),
        )

    def predict(self, features: Sequence[float], engine_id: int | None = None) -> float:
        """Predicted time (s) of the phase whose summed features are ``features``."""
        kind = "prefill" if features[4] else "decode"
        return self.rls.predict_list(features) * self.residual(engine_id, kind)

    def decode_step_s(self, batch: float, context: float, prefill_tokens: float = 0.0) -> float:
        """Type-level time of one decode step beside ``prefill_tokens`` interleaved prefill
        tokens (no residual)."""
        _a0, b0, b1, b2, _a1, _a2, _a3, m1 = self.rls.coef
        return b0 + b1 * batch + b2 * context + m1 * prefill_tokens

    def prefill_s(self, n: int, c: int = 0, batch: float = 0, context: float = 0) -> float:
        """Type-level time of a chunked prefill (see :func:`prefill_features`), no residual."""
        if n <= 0:
            return 0.0
        a0, b0, b1, b2, a1, a2, a3, _m1 = self.rls.coef
        steps, sq, nc = chunk_sums(n, c, self.budget)
        base = (b0 + b1 * batch + b2 * context) if batch > 0 else a0
        return steps * base + a1 * n + a2 * sq + a3 * nc

    def prefill_compute_s(self, n: int, c: int = 0) -> float:
        """The chunk work of a prefill alone (what co-running decodes are delayed by)."""
        if n <= 0:
            return 0.0
        _a0, _b0, _b1, _b2, a1, a2, a3, _m1 = self.rls.coef
        _steps, sq, nc = chunk_sums(n, c, self.budget)
        return a1 * n + a2 * sq + a3 * nc

    def p90_factor(self, kind: str) -> float:
        """Conformal p90 factor for ``kind`` (``"prefill"`` or ``"decode"``)."""
        return self.bounds[kind].factor()

    # -- calibration -----------------------------------------------------------------------

    def observe(
        self,
        features: Sequence[float],
        time_s: float,
        *,
        kind: str = "prefill",
        engine_id: int | None = None,
    ) -> None:
        """Fold in one measured phase.

        Parameters
        ----------
        features : sequence of float
            Summed step features of the phase (8 values).
        time_s : float
            Its measured duration, seconds (> 0).
        kind : {"prefill", "decode"}
            Which conformal window the out-of-sample ratio goes to.
        engine_id : int, optional
            The engine measured (for its residual).

        Raises
        ------
        ValueError
            Unknown kind, non-positive or non-finite time, wrong feature count.
        """
        bound = self.bounds.get(kind)
        if bound is None:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        time_s = float(time_s)  # a numpy scalar must not leak into the exported state
        if not (time_s > 0.0 and math.isfinite(time_s)):
            raise ValueError(f"time_s must be positive and finite, got {time_s}")
        if not self.calibrate:
            return
        if engine_id is not None:
            engine_id = int(engine_id)
        base = self.rls.predict_list(features)
        res = None
        if engine_id is not None:
            table = self._residuals[kind]
            res = table.get(engine_id)
            if res is None:
                if len(table) >= self.max_engines:
                    old = table.pop(next(iter(table)))
                    self._log_sum[kind] -= old.log_ratio
                res = table[engine_id] = _Residual()
        factor = self.residual(engine_id, kind)
        bound.add(time_s, base * factor)
        # Each kind calibrates its own block: a prefill phase's decode part (the batch it
        # ran beside, its queue's steps) is an offset from the decode coefficients, and
        # vice versa. Request-level prefill features are approximations; letting their
        # mismatch into b0/b1/b2 made the decode fit diverge in a closed-loop run.
        own, offset = self._split(features, kind)
        self.rls.update(own, time_s / factor, offset)
        self.samples_by_kind[kind] += 1
        if res is not None and base > 0.0:
            step = math.log(time_s / base)
            step = max(-_RESIDUAL_CLIP, min(_RESIDUAL_CLIP, step))
            res.count += 1
            alpha = max(_RESIDUAL_ALPHA, 1.0 / (res.count + 10))
            delta = alpha * (step - res.log_ratio)
            res.log_ratio += delta
            self._log_sum[kind] += delta

    def _split(self, features: Sequence[float], kind: str) -> tuple[list[float], float]:
        """(features of ``kind``'s coefficients, the rest's predicted contribution)."""
        coef = self.rls.coef
        own = list(features)
        offset = 0.0
        for j in _DECODE_IDX if kind == "prefill" else _PREFILL_IDX:
            if own[j]:
                offset += coef[j] * own[j]
                own[j] = 0.0
        return own, offset

    # -- export ----------------------------------------------------------------------------

    def state(self) -> StepModelState:
        """The calibration as plain data."""
        rls = self.rls
        return StepModelState(
            coef=dict(zip(COEF_NAMES, rls.coef, strict=True)),
            n_samples=rls.n_samples,
            effective_samples=rls.weight_sum,
            sigma_rel=rls.sigma,
            abs_rel_err=rls.abs_rel_err,
            p90_factor={kind: b.factor() for kind, b in self.bounds.items()},
            residuals={
                kind: {e: self.residual(e, kind) for e in table}
                for kind, table in self._residuals.items()
            },
            calibrate=self.calibrate,
            information=rls.information(),
            samples_by_kind=dict(self.samples_by_kind),
        )

    def load(self, state: StepModelState, *, residuals: bool = False) -> None:
        """Start from published coefficients (e.g. a controller's group fit).

        Parameters
        ----------
        state : StepModelState
        residuals : bool
            Also adopt the per-engine residuals (only meaningful for the same fleet).
        """
        # A state from before m1 existed lacks it (and has a 7x7 information matrix):
        # start m1 from the nominal and the information from the sample count.
        coef = dict(state.coef)
        information = state.information or None
        if "m1_s" not in coef:
            coef["m1_s"] = self.nominal.coef()[-1]
            information = None
        missing = set(COEF_NAMES) - set(coef)
        if missing:
            raise ValueError(f"state lacks coefficients {sorted(missing)}")
        self.rls.load([coef[n] for n in COEF_NAMES], state.n_samples, state.sigma_rel, information)
        for kind, count in state.samples_by_kind.items():
            if kind in self.samples_by_kind:
                self.samples_by_kind[kind] = int(count)
        if residuals:
            for kind, factors in state.residuals.items():
                if kind not in self._residuals:
                    continue
                for engine, factor in factors.items():
                    res = self._residuals[kind].setdefault(int(engine), _Residual())
                    log_ratio = math.log(max(float(factor), 1e-6))
                    self._log_sum[kind] += log_ratio - res.log_ratio
                    res.log_ratio = log_ratio
                    res.count = max(res.count, 50)

    def reset(self) -> None:
        """Back to the nominal constants."""
        self.rls.reset()
        for b in self.bounds.values():
            b.reset()
        for table in self._residuals.values():
            table.clear()
        self._log_sum = dict.fromkeys(KINDS, 0.0)
        self.samples_by_kind = dict.fromkeys(KINDS, 0)
