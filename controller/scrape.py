"""The controller's own engine scrapes: ``/metrics`` (vLLM names, old and new) and ``/health``.

Every ``controller.scrape_interval_s`` a round of the shared scraper
(:class:`fastroute.signals.scrape.EngineScraper`: bounded concurrency,
``controller.scrape_timeout_s`` per engine, parsing off the event loop) fetches every engine's
``/metrics`` and ``/health``. What this module adds is what the controller does with the samples:
it accumulates *windows*. Between two successive good scrapes of an engine the cumulative
histograms give the TTFT and inter-token-latency observations (their counts and sums,
:func:`count_sum_window`; an engine restart, counters going backwards, drops that interval)
and the completed requests (``e2e`` count) over the elapsed time give the served rate.

:meth:`EngineScraper.drain` closes the window once per control period (:class:`ScrapeWindow`):
per-engine counts and sums of TTFT and TBOT (engine-side, without network), the completed request
rate, and the last gauges (running, waiting, KV-cache usage). An engine is **stale** when its last
good ``/metrics`` scrape is older than ``stale_after_s`` (or there was none); its window is empty,
``GET /v1/plan`` shows the age and last error, and ``fastroute_controller_engine_stale`` is 1.
``/health`` answering anything but 200 is shown as ``healthy: false`` (the engine is loading or
draining); it does not derate by itself (the proxies eject, the anomaly score derates).
Each engine's prefix-cache hit rate over the last minute of scrapes (its own token counters,
:mod:`fastroute.signals.prefix_cache`) is kept beside the windows (:meth:`prefix_hit_rates`).

Memory is O(engines): two parsed scrapes and one window accumulator per engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from fastroute.config import EngineConfig
from fastroute.signals import scrape
from fastroute.signals.prefix_cache import UNKNOWN, PrefixHitRate
from fastroute.signals.scrape import MAX_METRICS_BYTES, EngineScrape
from fastroute.signals.vllm import CumulativeHistogram, EngineSignals

__all__ = [
    "MAX_METRICS_BYTES",
    "EngineScrapeState",
    "EngineScraper",
    "ScrapeWindow",
    "count_sum_window",
]

FloatArray = npt.NDArray[np.float64]


@dataclass
class EngineScrapeState(EngineScrape):
    """What the controller knows from scraping one engine: the scrapes and the open window.

    Attributes
    ----------
    ttft_count, ttft_sum_s, tbot_count, tbot_sum_s, completed, covered_s : float
        The open window: observations, completed requests and time between good scrapes.
    """

    ttft_count: float = 0.0
    ttft_sum_s: float = 0.0
    tbot_count: float = 0.0
    tbot_sum_s: float = 0.0
    completed: float = 0.0
    covered_s: float = 0.0

    def absorb(self, by_model: dict[str, EngineSignals]) -> None:
        """Keep the scrape and add the interval since the previous good one to the window."""
        old = self.signals
        super().absorb(by_model)
        new = self.signals
        assert new is not None
        if old is None:
            return
        for name in ("ttft_s", "itl_s"):
            cur = getattr(new, name)
            if cur is None:
                continue
            win = count_sum_window(getattr(old, name), cur)
            if win is None:
                return  # the engine restarted: this interval is unknown
            if name == "ttft_s":
                self.ttft_count += win[0]
                self.ttft_sum_s += win[1]
            else:
                self.tbot_count += win[0]
                self.tbot_sum_s += win[1]
        if new.e2e_s is not None and old.e2e_s is not None:
            done = new.e2e_s.count - old.e2e_s.count
            if done >= 0:
                self.completed += done
                self.covered_s += max(0.0, new.scraped_at_s - old.scraped_at_s)

    def reset_window(self) -> None:
        """Start a new window (the parsed scrapes are kept)."""
        self.ttft_count = self.ttft_sum_s = self.tbot_count = self.tbot_sum_s = 0.0
        self.completed = self.covered_s = 0.0


@dataclass(frozen=True, eq=False)
class ScrapeWindow:
    """One control period of scraped signals, arrays shape ``(n_engines,)``.

    Attributes
    ----------
    ttft_count, ttft_sum_s, tbot_count, tbot_sum_s : ndarray
        Engine-side TTFT and inter-token latency observations and their sums (s).
    load_rps : ndarray
        Completed requests per second (NaN where unknown).
    running, waiting, kv_cache_usage : ndarray
        The last gauges (NaN where unknown).
    stale : ndarray of bool
        No good ``/metrics`` scrape within ``stale_after_s``.
    prefix_hits : tuple of PrefixHitRate
        Per engine, its prefix-cache window (:meth:`EngineScraper.prefix_hit_rates`: queried,
        cached and generated tokens over the last minute; unknown for a stale engine).
    """

    ttft_count: FloatArray
    ttft_sum_s: FloatArray
    tbot_count: FloatArray
    tbot_sum_s: FloatArray
    load_rps: FloatArray
    running: FloatArray
    waiting: FloatArray
    kv_cache_usage: FloatArray
    stale: npt.NDArray[np.bool_] = field(repr=False)
    prefix_hits: tuple[PrefixHitRate, ...] = field(default=(), repr=False)


def count_sum_window(
    previous: CumulativeHistogram | None, current: CumulativeHistogram
) -> tuple[float, float] | None:
    """``(count, sum)`` of :func:`~fastroute.signals.vllm.histogram_window`, None on a reset.

    The windows only need the two totals, so the per-bucket differences (most of the cost,
    four engines a second) are not computed.
    """
    if previous is None:
        return current.count, current.sum
    if current.count < previous.count:
        return None
    return current.count - previous.count, current.sum - previous.sum


def _gauge(value: float | None) -> float:
    return float("nan") if value is None else float(value)


class EngineScraper(scrape.EngineScraper[EngineScrapeState]):
    """Scrape every engine's ``/metrics`` and ``/health`` into windows (see module doc).

    Parameters
    ----------
    engines : sequence of EngineConfig
    stale_after_s : float, optional
        Age of the last good scrape beyond which an engine is stale; default
        ``3 · interval_s``.
    **options
        ``interval_s``, ``timeout_s`` (bound on one engine's round: both requests and parsing),
        ``max_concurrency`` and ``clock`` (Unix seconds) of
        :class:`fastroute.signals.scrape.EngineScraper`.

    Attributes
    ----------
    states : list of EngineScrapeState
        Per engine, in the order of ``engines`` (the same objects as ``results``).
    """

    def __init__(
        self,
        engines: Sequence[EngineConfig],
        *,
        stale_after_s: float | None = None,
        **options: Any,
    ) -> None:
        super().__init__(engines, health=True, new_result=EngineScrapeState, **options)
        self.stale_after_s = 3.0 * self.interval_s if stale_after_s is None else stale_after_s
        self.states = list(self.results.values())

    def stale(self, now_s: float | None = None) -> npt.NDArray[np.bool_]:
        """Per engine: no good scrape within ``stale_after_s``."""
        now = self.clock() if now_s is None else now_s
        ages = [s.age_s(now) for s in self.states]
        return np.array([a is None or a > self.stale_after_s for a in ages], dtype=bool)

    def drain(self, now_s: float | None = None) -> ScrapeWindow:
        """Close the window (see module doc); stale engines contribute no observations."""
        stale = self.stale(now_s)
        n = len(self.states)
        cols: dict[str, FloatArray] = {
            k: np.zeros(n) for k in ("ttft_count", "ttft_sum_s", "tbot_count", "tbot_sum_s")
        }
        gauges = {k: np.full(n, np.nan) for k in ("load_rps", "running", "waiting", "kv")}
        for i, s in enumerate(self.states):
            if not stale[i]:
                cols["ttft_count"][i], cols["ttft_sum_s"][i] = s.ttft_count, s.ttft_sum_s
                cols["tbot_count"][i], cols["tbot_sum_s"][i] = s.tbot_count, s.tbot_sum_s
                if s.covered_s > 0:
                    gauges["load_rps"][i] = s.completed / s.covered_s
                sig = s.signals
                assert sig is not None
                gauges["running"][i] = _gauge(sig.num_requests_running)
                gauges["waiting"][i] = _gauge(sig.num_requests_waiting)
                gauges["kv"][i] = _gauge(sig.kv_cache_usage)
            s.reset_window()
        return ScrapeWindow(
            **cols,
            load_rps=gauges["load_rps"],
            running=gauges["running"],
            waiting=gauges["waiting"],
            kv_cache_usage=gauges["kv"],
            stale=stale,
            prefix_hits=tuple(
                UNKNOWN if stale[i] else st.prefix_hits.current for i, st in enumerate(self.states)
            ),
        )

    def state(self, i: int, now_s: float | None = None) -> dict[str, Any]:
        """JSON-able scrape state of engine ``i`` (for ``GET /v1/plan``)."""
        now = self.clock() if now_s is None else now_s
        s = self.states[i]
        sig = s.signals
        age = s.age_s(now)
        return {
            "age_s": age,
            "stale": age is None or age > self.stale_after_s,
            "healthy": s.healthy,
            "error": s.error,
            "scrapes_total": s.scrapes_total,
            "errors_total": s.errors_total,
            "running": None if sig is None else sig.num_requests_running,
            "waiting": None if sig is None else sig.num_requests_waiting,
            "kv_cache_usage": None if sig is None else sig.kv_cache_usage,
            "prefix_cache": s.prefix_hits.current.as_json(),
        }

    def prefix_hit_rates(self, now_s: float | None = None) -> list[PrefixHitRate]:
        """Per engine, its windowed prefix-cache hit rate; a stale engine's is unknown."""
        stale = self.stale(now_s)
        return [UNKNOWN if stale[i] else s.prefix_hits.current for i, s in enumerate(self.states)]
