"""Metrics of docs/metrics.md, computed from per-request records and weight tables.

Everything a report shows is computed here, once: :func:`summarize` for the request
metrics (latency percentiles overall and per class and region, SLO attainment,
goodput, prefix-cache hit rate, affinity loss, shed/failure/retry rates) and
:func:`weight_churn` / :func:`weight_amplitude` for the control plane's weight series.
The simulator adds its fleet counters (preemptions, utilisation) next to these.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import numpy as np

from fastroute.sim.records import RequestRecord

__all__ = [
    "Slo",
    "PERCENTILES",
    "latency_stats",
    "summarize",
    "affinity_loss",
    "weight_churn",
    "weight_amplitude",
]

#: Percentiles reported for every latency.
PERCENTILES: tuple[int, ...] = (50, 90, 99)


class Slo(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Latency objectives a served request must meet to count towards goodput.

    Attributes
    ----------
    ttft_s : float
        Time to first token bound, > 0.
    tbot_s : float
        Bound on the request's mean time between output tokens, > 0.
    """

    ttft_s: float = 2.0
    tbot_s: float = 0.1

    def met(self, record: RequestRecord) -> bool:
        """True iff the record is ok and within both bounds (one-token replies: TTFT only)."""
        ttft = record.ttft_s
        if record.outcome != "ok" or ttft is None or ttft > self.ttft_s:
            return False
        tbot = record.tbot_s
        return tbot is None or tbot <= self.tbot_s


def latency_stats(values: Sequence[float] | np.ndarray) -> dict[str, float | None]:
    """Mean and :data:`PERCENTILES` (linear interpolation) of ``values``; None when empty."""
    arr = np.asarray(values, dtype=np.float64)
    keys = ["mean", *(f"p{p}" for p in PERCENTILES)]
    if arr.size == 0:
        return dict.fromkeys(keys)
    pct = np.percentile(arr, PERCENTILES)
    out: dict[str, float | None] = {"mean": float(arr.mean())}
    out.update({f"p{p}": float(v) for p, v in zip(PERCENTILES, pct, strict=True)})
    return out


def affinity_loss(records: Iterable[RequestRecord]) -> tuple[float | None, int]:
    """Share of follow-up requests whose session's previous request went to another engine.

    Only pairs of consecutive requests of a session that both reached an engine count.

    Returns
    -------
    (loss, pairs) : (float or None, int)
        The share (None without pairs) and the number of pairs compared.
    """
    by_session: dict[str, list[tuple[int, str]]] = {}
    for r in records:
        if r.engine and r.session_id:
            by_session.setdefault(r.session_id, []).append((r.turn, r.engine))
    pairs = moved = 0
    for turns in by_session.values():
        if len(turns) < 2:
            continue
        turns.sort()
        for (_, a), (_, b) in zip(turns, turns[1:], strict=False):
            pairs += 1
            moved += a != b
    return (moved / pairs if pairs else None), pairs


def _group_summary(records: list[RequestRecord], slo: Slo, duration_s: float) -> dict[str, Any]:
    n = len(records)
    ok = [r for r in records if r.outcome == "ok"]
    shed = sum(r.outcome == "shed" for r in records)
    failed = sum(r.outcome == "failed" for r in records)
    attempts = sum(r.attempts for r in records)
    good = [r for r in ok if slo.met(r)]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tbot = [t for t in (r.tbot_s for r in ok) if t is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    known = [r for r in ok if r.cached_tokens >= 0]
    prompt_known = sum(r.prompt_tokens for r in known)
    loss, pairs = affinity_loss(records)
    prompt_all = sum(r.prompt_tokens for r in records)
    return {
        "requests": n,
        "ok": len(ok),
        "shed": shed,
        "failed": failed,
        "shed_rate": shed / n if n else None,
        "failure_rate": failed / n if n else None,
        "attempts": attempts,
        "retry_rate": (attempts - (n - shed)) / (n - shed) if n - shed else None,
        "load_amplification": attempts / n if n else None,
        "slo_attainment": len(good) / n if n else None,
        "goodput_rps": len(good) / duration_s if duration_s > 0 else None,
        "goodput_tokens_per_s": (
            sum(r.output_tokens for r in good) / duration_s if duration_s > 0 else None
        ),
        "throughput_rps": len(ok) / duration_s if duration_s > 0 else None,
        "ttft_s": latency_stats(ttft),
        "tbot_s": latency_stats(tbot),
        "e2e_s": latency_stats(e2e),
        "prefix_hit_rate": (
            sum(r.cached_tokens for r in known) / prompt_known if prompt_known else None
        ),
        "affinity_loss": loss,
        "affinity_pairs": pairs,
        "preemptions": sum(r.preemptions for r in records if r.preemptions > 0),
        "hedges": sum(r.hedged for r in records),
        "hedges_won": sum(r.hedge_won for r in records),
        "hedge_extra_prefill": (
            sum(r.hedge_prefill_tokens for r in records) / prompt_all if prompt_all else None
        ),
    }


def summarize(
    records: Sequence[RequestRecord],
    *,
    slo: Slo | None = None,
    duration_s: float | None = None,
    group_by: Sequence[str] = ("cls", "source"),
) -> dict[str, Any]:
    """Request metrics overall and per group (docs/metrics.md).

    Parameters
    ----------
    records : sequence of RequestRecord
    slo : Slo, optional
        Objectives for SLO attainment and goodput (default :class:`Slo`).
    duration_s : float, optional
        Denominator of the rates (goodput, throughput); default the span from the first
        arrival to the last finish.
    group_by : sequence of str
        Record attributes to break the metrics down by (each gives one table).

    Returns
    -------
    dict
        ``{"overall": {...}, "by_cls": {label: {...}}, "by_source": {...}, "slo": {...},
        "duration_s": ...}``; JSON-serialisable (floats or None).
    """
    slo = slo or Slo()
    recs = list(records)
    if duration_s is None:
        if recs:
            start = min(r.arrival_s for r in recs)
            end = max((r.finish_s for r in recs if r.finish_s is not None), default=start)
            duration_s = max(end - start, 0.0)
        else:
            duration_s = 0.0
    out: dict[str, Any] = {
        "duration_s": duration_s,
        "slo": msgspec.structs.asdict(slo),
        "overall": _group_summary(recs, slo, duration_s),
    }
    for attr in group_by:
        groups: dict[str, list[RequestRecord]] = {}
        for r in recs:
            groups.setdefault(str(getattr(r, attr)), []).append(r)
        out[f"by_{attr}"] = {
            k: _group_summary(v, slo, duration_s) for k, v in sorted(groups.items())
        }
    return out


def weight_churn(
    weights_prev: np.ndarray, weights_now: np.ndarray, demand_rps: np.ndarray
) -> float:
    """Demand-weighted total variation between two weight tables (0 … 1).

    ``TV = ½ Σ_g D_g Σ_e |w_now − w_prev| / Σ_g D_g``: the fraction of traffic whose
    destination changed (docs/algorithms.md §8.3). Rows are normalised first
    (all-zero rows stay zero); 0 when there is no demand.
    """
    w0 = _normalise(weights_prev)
    w1 = _normalise(weights_now)
    d = np.asarray(demand_rps, dtype=np.float64)
    total = float(d.sum())
    if total <= 0 or not math.isfinite(total):
        return 0.0
    return float(0.5 * d @ np.abs(w1 - w0).sum(axis=1) / total)


def _normalise(w: np.ndarray) -> np.ndarray:
    w = np.asarray(w, dtype=np.float64)
    s = w.sum(axis=1, keepdims=True)
    return np.divide(w, s, out=np.zeros_like(w), where=s > 0)


def weight_amplitude(series: np.ndarray) -> float:
    """Largest per-(class, engine) range ``max − min`` of normalised weights over a series.

    Parameters
    ----------
    series : ndarray, shape (n_periods, n_classes, n_engines)
    """
    arr = np.asarray(series, dtype=np.float64)
    if arr.shape[0] == 0:
        return 0.0
    norm = np.stack([_normalise(w) for w in arr])
    return float((norm.max(axis=0) - norm.min(axis=0)).max())
