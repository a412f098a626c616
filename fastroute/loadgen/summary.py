"""Summaries of a run's request records: latency percentiles, per-engine shares, goodput.

Definitions (client side):

* percentiles are linearly interpolated (``numpy.percentile``, as in
  ``docs/metrics.md``) over successful requests; TTFT only for streamed requests, TBOT
  only for responses of at least two tokens;
* a request **meets its SLO** if it succeeded, its TTFT ≤ ``ttft_slo_s`` and its TBOT
  ≤ ``tbot_slo_s`` (as ``docs/metrics.md``: a one-token reply has no TBOT; a
  non-streamed reply has no TTFT, so only its TBOT counts);
* **SLO attainment** = requests meeting the SLO / requests sent; **goodput** = requests
  meeting the SLO per second of the run;
* **prefix-cache hit rate** (from the responses' ``usage``) = Σ cached prompt tokens /
  Σ prompt tokens of the successful requests that reported usage;
* ``rejects_429`` counts the 429s by the ``code`` of their error body (``load_shed``,
  ``overloaded``, ``slo_infeasible``... see :mod:`fastroute.loadgen.records`),
  :data:`NO_CODE` for a body without one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import msgspec
import numpy as np

from fastroute.loadgen.records import RequestRecord

__all__ = ["NO_CODE", "percentile", "LatencySummary", "EngineSummary", "RunSummary", "summarize"]

#: The ``rejects_429`` key of a 429 whose body carried no error code.
NO_CODE = "no_code"


def percentile(values: Sequence[float], q: float) -> float | None:
    """Percentile ``q`` in [0, 1] of ``values``, linearly interpolated; None when empty."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q * 100.0))


class LatencySummary(msgspec.Struct, kw_only=True):
    """p50 / p90 / p99 of one latency, seconds (None without samples)."""

    n: int
    p50_s: float | None
    p90_s: float | None
    p99_s: float | None
    mean_s: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> LatencySummary:
        """Summarise ``values`` (seconds)."""
        return cls(
            n=len(values),
            p50_s=percentile(values, 0.50),
            p90_s=percentile(values, 0.90),
            p99_s=percentile(values, 0.99),
            mean_s=sum(values) / len(values) if values else None,
        )


class EngineSummary(msgspec.Struct, kw_only=True):
    """What one engine served, as the client saw it."""

    engine: str
    requests: int
    share: float
    ttft: LatencySummary
    tbot: LatencySummary
    cache_hit_rate: float | None


class RunSummary(msgspec.Struct, kw_only=True):
    """Totals of a run and one :class:`EngineSummary` per engine (by name)."""

    requests: int
    ok: int
    errors: dict[str, int]
    rejects_429: dict[str, int] = msgspec.field(default_factory=dict)
    wall_s: float
    output_tokens: int
    ttft: LatencySummary
    tbot: LatencySummary
    e2e: LatencySummary
    slo_met: int
    slo_attainment: float | None
    goodput_rps: float
    throughput_rps: float
    cache_hit_rate: float | None
    engines: list[EngineSummary]


def _cache_rate(records: Iterable[RequestRecord]) -> float | None:
    prompt = cached = 0
    for r in records:
        if r.ok and r.prompt_tokens and r.cached_tokens is not None:
            prompt += r.prompt_tokens
            cached += r.cached_tokens
    return cached / prompt if prompt else None


def meets_slo(record: RequestRecord, ttft_slo_s: float, tbot_slo_s: float) -> bool:
    """Whether ``record`` succeeded within both SLOs (see the module doc)."""
    if not record.ok:
        return False
    if record.ttft_s is not None and record.ttft_s > ttft_slo_s:
        return False
    return record.tbot_s is None or record.tbot_s <= tbot_slo_s


def summarize(
    records: Sequence[RequestRecord],
    wall_s: float,
    *,
    ttft_slo_s: float = 2.0,
    tbot_slo_s: float = 0.1,
) -> RunSummary:
    """Summarise a run's records.

    Parameters
    ----------
    records : sequence of RequestRecord
    wall_s : float
        Length of the run, seconds (rates divide by it).
    ttft_slo_s, tbot_slo_s : float
        The SLOs of goodput (the defaults are fastroute's class defaults).
    """
    ok = [r for r in records if r.ok]
    errors = Counter(r.error for r in records if r.error is not None)
    rejects = Counter(r.error_code or NO_CODE for r in records if r.error == "http_429")
    slo_met = sum(1 for r in records if meets_slo(r, ttft_slo_s, tbot_slo_s))
    by_engine: dict[str, list[RequestRecord]] = {}
    for r in records:
        if r.engine is not None:
            by_engine.setdefault(r.engine, []).append(r)
    routed = sum(len(v) for v in by_engine.values())
    engines = [
        EngineSummary(
            engine=name,
            requests=len(rs),
            share=len(rs) / routed if routed else 0.0,
            ttft=LatencySummary.of([r.ttft_s for r in rs if r.ok and r.ttft_s is not None]),
            tbot=LatencySummary.of([r.tbot_s for r in rs if r.ok and r.tbot_s is not None]),
            cache_hit_rate=_cache_rate(rs),
        )
        for name, rs in sorted(by_engine.items())
    ]
    span = wall_s if wall_s > 0 else float("nan")
    return RunSummary(
        requests=len(records),
        ok=len(ok),
        errors=dict(sorted(errors.items())),
        rejects_429=dict(sorted(rejects.items())),
        wall_s=wall_s,
        output_tokens=sum(r.output_tokens for r in ok),
        ttft=LatencySummary.of([r.ttft_s for r in ok if r.ttft_s is not None]),
        tbot=LatencySummary.of([r.tbot_s for r in ok if r.tbot_s is not None]),
        e2e=LatencySummary.of([r.e2e_s for r in ok if r.e2e_s is not None]),
        slo_met=slo_met,
        slo_attainment=slo_met / len(records) if records else None,
        goodput_rps=slo_met / span if wall_s > 0 else 0.0,
        throughput_rps=len(ok) / span if wall_s > 0 else 0.0,
        cache_hit_rate=_cache_rate(ok),
        engines=engines,
    )
