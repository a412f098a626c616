"""Prefix-cache hit rates from an engine's scrapes: per engine over a window, and fleet-wide.

vLLM (``vllm:prefix_cache_queries_total`` / ``…_hits_total``) and SGLang
(``sglang:prompt_tokens_total`` / ``sglang:cached_tokens_total``) count prompt tokens queried and
found in the prefix cache since the engine started. The hit rate over a window is
Δhits / Δqueries between the window's first and last scrape (:class:`PrefixHitTracker`):

* counters going backwards mean the engine restarted: the counts since the restart are the
  window's (the restart happened after the previous scrape) and ``reset`` says so;
* Δqueries = 0 is **no traffic** (``status="no_traffic"``, rate None), not a 0 % hit rate;
* an engine that reports a rate but no counters (SGLang's ``sglang:cache_hit_rate``, the oldest
  vLLM's ``vllm:gpu_prefix_cache_hit_rate``) has that rate as is (``source="gauge"``: the
  engine's own recent window, whose span fastroute does not know);
* an engine that reports neither is **unknown** (``status="unknown"``), never 0.

Counters win over a gauge when an engine has both: they are token counts, so they can be
windowed and weighted. :func:`fleet_hit_rate` is the token-weighted fleet figure, Σ Δhits /
Σ Δqueries over the engines with counters (engines with only a gauge carry no token weight and
are left out; ``engines`` says how many were counted).

The first scrape of an engine has no earlier one: its window is the engine's lifetime
(``start_s`` None, "since the engine started").

The same window also counts the engine's generated tokens (``generation_tokens_total``, when
it reports them): queried, cached and generated tokens together are the engine's token work
over the window, from which the controller rates how much prefix reuse raises its capacity
(:mod:`controller.reuse`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import Literal

import msgspec

from fastroute.signals.vllm import EngineSignals

__all__ = [
    "DEFAULT_WINDOW_S",
    "PrefixHitRate",
    "PrefixHitTracker",
    "UNKNOWN",
    "fleet_hit_rate",
]

#: Span of the rolling window of :class:`PrefixHitTracker`, seconds: long enough to hold many
#: requests at a scrape interval of seconds, short enough to follow a change of workload.
DEFAULT_WINDOW_S = 60.0

HitStatus = Literal["ok", "no_traffic", "unknown"]
HitSource = Literal["counters", "gauge"]


class PrefixHitRate(msgspec.Struct, frozen=True, kw_only=True):
    """The prefix-cache hit rate of one engine (or the fleet) over one window.

    Attributes
    ----------
    status : {"ok", "no_traffic", "unknown"}
        ``ok``: ``rate`` is known; ``no_traffic``: no prompt token queried in the window;
        ``unknown``: the engine reports neither counters nor a rate (or was never scraped).
    rate : float or None
        Hits per queried prompt token, 0..1; None unless ``status == "ok"``.
    source : {"counters", "gauge"} or None
        Token counters windowed here, or the engine's own rate gauge.
    hits_tokens, queries_tokens : float or None
        Δhits and Δqueries over the window (counters only).
    generated_tokens : float or None
        Δ generated (output) tokens over the same window; None when the engine does not
        count them (or a counter of the window is missing).
    start_s, end_s : float or None
        Unix seconds of the window's first and last scrape; ``start_s`` None: since the
        engine started (one scrape so far, or a gauge's window).
    reset : bool
        The engine restarted within the window (its counters went backwards).
    engines : int
        Engines whose counts are in the figure (1 for one engine; the fleet's count).
    """

    status: HitStatus
    rate: float | None = None
    source: HitSource | None = None
    hits_tokens: float | None = None
    queries_tokens: float | None = None
    generated_tokens: float | None = None
    start_s: float | None = None
    end_s: float | None = None
    reset: bool = False
    engines: int = 0

    @property
    def window_s(self) -> float | None:
        """Seconds the window covers; None when its start is not known."""
        if self.start_s is None or self.end_s is None:
            return None
        return self.end_s - self.start_s

    def as_json(self) -> dict[str, object]:
        """JSON-able fields and ``window_s`` (for ``GET /v1/plan``)."""
        out: dict[str, object] = {f: getattr(self, f) for f in self.__struct_fields__}
        out["window_s"] = self.window_s
        return out


#: The rate of an engine with no prefix-cache signal.
UNKNOWN = PrefixHitRate(status="unknown")


def _counted(
    hits: float,
    queries: float,
    generated: float | None,
    start_s: float | None,
    end_s: float,
    reset: bool,
) -> PrefixHitRate:
    if queries <= 0:
        status: HitStatus = "no_traffic"
        rate = None
    else:
        status, rate = "ok", min(1.0, max(0.0, hits / queries))
    return PrefixHitRate(
        status=status, rate=rate, source="counters", hits_tokens=hits, queries_tokens=queries,
        generated_tokens=generated, start_s=start_s, end_s=end_s, reset=reset, engines=1,
    )  # fmt: skip


class PrefixHitTracker:
    """The rolling-window prefix-cache hit rate of one engine, fed one scrape at a time.

    Keeps the scrapes of the last ``window_s`` seconds and the newest one before them (the
    window's base), so the window covers at least ``window_s`` once the engine has been
    scraped that long. Memory: one ``(time, queries, hits, generated)`` tuple per scrape in
    the window (generated NaN when the engine does not count them).

    Parameters
    ----------
    window_s : float
        Span of the window, seconds (> 0).

    Attributes
    ----------
    current : PrefixHitRate
        The rate after the last :meth:`update` (:data:`UNKNOWN` before the first).
    """

    __slots__ = ("window_s", "current", "_samples", "_reset_at_s")

    def __init__(self, window_s: float = DEFAULT_WINDOW_S) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.window_s = window_s
        self.current = UNKNOWN
        self._samples: deque[tuple[float, float, float, float]] = deque()
        self._reset_at_s: float | None = None

    def update(self, signals: EngineSignals) -> PrefixHitRate:
        """Take one good scrape (engine-wide signals) and return the window's rate."""
        q, h = signals.prefix_cache_queries_total, signals.prefix_cache_hits_total
        if q is None or h is None:
            self._samples.clear()
            self._reset_at_s = None
            gauge = signals.prefix_cache_hit_rate
            if gauge is None:
                self.current = UNKNOWN
            else:
                end = signals.scraped_at_s
                self.current = PrefixHitRate(
                    status="ok", rate=gauge, source="gauge", end_s=end, engines=1
                )
            return self.current
        g = signals.generation_tokens_total
        self.current = self._window(signals.scraped_at_s, q, h, math.nan if g is None else g)
        return self.current

    def _window(self, now_s: float, q: float, h: float, g: float) -> PrefixHitRate:
        samples = self._samples
        if samples and (q < samples[-1][1] or h < samples[-1][2] or g < samples[-1][3]):
            # restarted after the last scrape: what it counted since is this window's
            last_s = samples[-1][0]
            samples.clear()
            samples.append((last_s, 0.0, 0.0, 0.0))
            self._reset_at_s = last_s
        samples.append((now_s, q, h, g))
        while len(samples) > 2 and samples[1][0] <= now_s - self.window_s:
            samples.popleft()
        t0, q0, h0, g0 = samples[0]
        if len(samples) == 1:
            return _counted(h, q, _finite(g), None, now_s, False)
        if self._reset_at_s is not None and self._reset_at_s < t0:
            self._reset_at_s = None  # the restart left the window
        return _counted(h - h0, q - q0, _finite(g - g0), t0, now_s, self._reset_at_s is not None)


def _finite(x: float) -> float | None:
    """``x``, or None for the NaN of a generation counter the engine does not report."""
    return None if math.isnan(x) else x


def fleet_hit_rate(rates: Iterable[PrefixHitRate]) -> PrefixHitRate:
    """The token-weighted hit rate of several engines' windows (see the module doc).

    Only windows from counters count (a gauge has no token weight). The result spans the
    earliest start to the latest end (``start_s`` None if any counted window has no start);
    its ``generated_tokens`` is the sum when every counted window has one, else None.
    """
    hits = queries = 0.0
    generated: float | None = 0.0
    n = 0
    starts: list[float | None] = []
    ends: list[float] = []
    reset = False
    for r in rates:
        if r.source != "counters" or r.queries_tokens is None or r.hits_tokens is None:
            continue
        n += 1
        hits += r.hits_tokens
        queries += r.queries_tokens
        generated = (
            None
            if generated is None or r.generated_tokens is None
            else (generated + r.generated_tokens)
        )
        starts.append(r.start_s)
        if r.end_s is not None:
            ends.append(r.end_s)
        reset = reset or r.reset
    if n == 0:
        return UNKNOWN
    start = None if any(s is None for s in starts) else min(s for s in starts if s is not None)
    out = _counted(hits, queries, generated, start, max(ends) if ends else 0.0, reset)
    return msgspec.structs.replace(out, engines=n)
