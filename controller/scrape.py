"""The controller's own engine scrapes: ``/metrics`` (vLLM names, old and new) and ``/health``.

Every ``controller.scrape_interval_s`` :meth:`EngineScraper.scrape_once` fetches every engine's
``/metrics`` and ``/health`` concurrently (at most ``max_concurrency`` engines at once, each
engine's round bounded by ``controller.scrape_timeout_s``, bodies by :data:`MAX_METRICS_BYTES`),
parses them with :func:`fastroute.signals.vllm.parse_vllm_metrics` (both vLLM generations) off the
event loop, and accumulates *windows*: between two successive good scrapes of an engine the
cumulative histograms give the TTFT and inter-token-latency observations
(:func:`histogram_window`; an engine restart, counters going backwards, drops that interval) and
the completed requests (``e2e`` count) over the elapsed time give the served rate.

:meth:`EngineScraper.drain` closes the window once per control period (:class:`ScrapeWindow`):
per-engine counts and sums of TTFT and TBOT (engine-side, without network), the completed request
rate, and the last gauges (running, waiting, KV-cache usage). An engine is **stale** when its last
good ``/metrics`` scrape is older than ``stale_after_s`` (or there was none); its window is empty,
``GET /v1/plan`` shows the age and last error, and ``fastroute_controller_engine_stale`` is 1.
``/health`` answering anything but 200 is shown as ``healthy: false`` (the engine is loading or
draining); it does not derate by itself (the proxies eject, the anomaly score derates).

Memory is O(engines): two parsed scrapes and one window accumulator per engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
import numpy.typing as npt

from fastroute.config import EngineConfig
from fastroute.signals.vllm import (
    EngineSignals,
    MetricsParseError,
    histogram_window,
    merge_signals,
    parse_vllm_metrics,
)

__all__ = ["MAX_METRICS_BYTES", "EngineScrapeState", "EngineScraper", "ScrapeWindow"]

log = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]

#: Largest ``/metrics`` body read.
MAX_METRICS_BYTES = 8 * 1024 * 1024
#: Largest ``/health`` body read.
MAX_HEALTH_BYTES = 64 * 1024


@dataclass
class EngineScrapeState:
    """What the controller knows from scraping one engine.

    Attributes
    ----------
    signals : EngineSignals or None
        The last good ``/metrics`` scrape (models merged).
    healthy : bool or None
        ``/health`` answered 200 at the last scrape (None: never answered).
    error : str or None
        The last scrape's error (None after a good one).
    scrapes_total, errors_total : int
    ttft_count, ttft_sum_s, tbot_count, tbot_sum_s, completed, covered_s : float
        The open window: observations, completed requests and time between good scrapes.
    """

    signals: EngineSignals | None = None
    healthy: bool | None = None
    error: str | None = None
    scrapes_total: int = 0
    errors_total: int = 0
    ttft_count: float = 0.0
    ttft_sum_s: float = 0.0
    tbot_count: float = 0.0
    tbot_sum_s: float = 0.0
    completed: float = 0.0
    covered_s: float = 0.0

    def age_s(self, now_s: float) -> float | None:
        """Seconds since the last good ``/metrics`` scrape; None if there was none."""
        return None if self.signals is None else max(0.0, now_s - self.signals.scraped_at_s)

    def absorb(self, new: EngineSignals) -> None:
        """Add the interval since the previous good scrape to the window, keep ``new``."""
        old = self.signals
        if old is not None:
            restarted = False
            for name in ("ttft_s", "itl_s"):
                cur = getattr(new, name)
                if cur is None:
                    continue
                win = histogram_window(getattr(old, name), cur)
                if win.reset:
                    restarted = True
                    break
                if name == "ttft_s":
                    self.ttft_count += win.count
                    self.ttft_sum_s += win.sum
                else:
                    self.tbot_count += win.count
                    self.tbot_sum_s += win.sum
            if not restarted and new.e2e_s is not None and old.e2e_s is not None:
                done = new.e2e_s.count - old.e2e_s.count
                if done >= 0:
                    self.completed += done
                    self.covered_s += max(0.0, new.scraped_at_s - old.scraped_at_s)
        self.signals = new
        self.error = None

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


def _gauge(value: float | None) -> float:
    return float("nan") if value is None else float(value)


class EngineScraper:
    """Scrape every engine's ``/metrics`` and ``/health`` (see module doc).

    Parameters
    ----------
    engines : sequence of EngineConfig
    interval_s : float
        Period between the starts of two rounds (:meth:`run`).
    timeout_s : float
        Bound on one engine's round (both requests and parsing wait).
    max_concurrency : int
        Engines scraped at once.
    stale_after_s : float, optional
        Age of the last good scrape beyond which an engine is stale; default
        ``3 · interval_s``.
    clock : callable
        Unix seconds.
    """

    def __init__(
        self,
        engines: Sequence[EngineConfig],
        *,
        interval_s: float = 1.0,
        timeout_s: float = 0.5,
        max_concurrency: int = 16,
        stale_after_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not (interval_s > 0 and timeout_s > 0 and max_concurrency >= 1):
            raise ValueError("interval_s and timeout_s must be > 0, max_concurrency >= 1")
        self.engines = tuple(engines)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.stale_after_s = 3.0 * interval_s if stale_after_s is None else stale_after_s
        self.clock = clock
        self.states = [EngineScrapeState() for _ in self.engines]
        self.rounds_total = 0
        self._session: aiohttp.ClientSession | None = None
        self._sem: asyncio.Semaphore | None = None

    async def _get(self, engine: EngineConfig, path: str, limit: int) -> tuple[int, bytes]:
        assert self._session is not None
        headers = {"Authorization": f"Bearer {engine.api_key}"} if engine.api_key else {}
        async with self._session.get(engine.url + path, headers=headers) as resp:
            return resp.status, await resp.content.read(limit + 1)

    async def _scrape(self, i: int) -> None:
        assert self._sem is not None
        engine, state = self.engines[i], self.states[i]
        state.scrapes_total += 1
        try:
            async with self._sem, asyncio.timeout(self.timeout_s):
                (m_status, body), (h_status, _) = await asyncio.gather(
                    self._get(engine, "/metrics", MAX_METRICS_BYTES),
                    self._get(engine, "/health", MAX_HEALTH_BYTES),
                )
                state.healthy = h_status == 200
                if m_status != 200:
                    raise MetricsParseError(f"/metrics answered HTTP {m_status}")
                if len(body) > MAX_METRICS_BYTES:
                    raise MetricsParseError(f"/metrics is over {MAX_METRICS_BYTES} bytes")
                by_model = await asyncio.to_thread(
                    parse_vllm_metrics,
                    body.decode("utf-8", errors="replace"),
                    scraped_at_s=self.clock(),
                )
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, TimeoutError, OSError, MetricsParseError) as exc:
            state.errors_total += 1
            text = (
                f"timeout after {self.timeout_s:g} s"
                if isinstance(exc, TimeoutError)
                else f"{type(exc).__name__}: {exc}"
            )
            if text != state.error:
                log.info("scrape of engine %s failed: %s", engine.name, text)
            state.error = text
            return
        state.absorb(merge_signals(list(by_model.values())))

    async def scrape_once(self) -> None:
        """One round over every engine; returns when each has answered or timed out."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_concurrency),
                timeout=aiohttp.ClientTimeout(total=None),
            )
            self._sem = asyncio.Semaphore(self.max_concurrency)
        await asyncio.gather(*(self._scrape(i) for i in range(len(self.engines))))
        self.rounds_total += 1

    async def run(self) -> None:
        """Scrape every ``interval_s`` until cancelled (a failed round never ends the loop)."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                started = loop.time()
                try:
                    await self.scrape_once()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("engine scrape round failed")
                await asyncio.sleep(max(0.0, started + self.interval_s - loop.time()))
        finally:
            await self.close()

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

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
        }
