"""Optional engine scraping by the proxy itself (``proxy.scrape_engines``; off by default).

Normally the controller scrapes engines. Without one, :class:`EngineScraper`
scrapes every engine's ``/metrics`` every ``scrape_interval_s``, all engines
concurrently (at most ``max_concurrency`` at once), each scrape bounded by
``scrape_timeout_s``. Results (:class:`EngineScrape`: the parsed
:class:`~fastroute.signals.vllm.EngineSignals`, their age, the last error) are kept
per engine name in :attr:`EngineScraper.results` for ``/metrics`` and the fleet
view. A failed scrape keeps the last good signals (their age grows).

Routing never waits on a scrape: the scraper is a background task on its own HTTP
session and connection pool (not the upstream pool), and parsing runs in a thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from fastroute.config import EngineConfig
from fastroute.signals.vllm import (
    EngineSignals,
    MetricsParseError,
    merge_signals,
    parse_vllm_metrics,
)

__all__ = ["EngineScrape", "EngineScraper", "MAX_METRICS_BYTES"]

logger = logging.getLogger(__name__)

#: Largest ``/metrics`` body read.
MAX_METRICS_BYTES = 8 * 1024 * 1024


@dataclass(slots=True)
class EngineScrape:
    """What the scraper knows about one engine.

    Attributes
    ----------
    engine : str
        Engine name.
    signals : EngineSignals or None
        Engine-wide signals of the last good scrape (models merged).
    by_model : dict of str to EngineSignals
        The same per ``model_name``.
    error : str or None
        The last scrape's error; None if it succeeded.
    scrapes_total, errors_total : int
    """

    engine: str
    signals: EngineSignals | None = None
    by_model: dict[str, EngineSignals] | None = None
    error: str | None = None
    scrapes_total: int = 0
    errors_total: int = 0

    def age_s(self, now_s: float | None = None) -> float | None:
        """Seconds since the last good scrape; None if there was none."""
        if self.signals is None:
            return None
        return max(0.0, (time.time() if now_s is None else now_s) - self.signals.scraped_at_s)


class EngineScraper:
    """Scrape the engines' ``/metrics`` in the background.

    Parameters
    ----------
    engines : sequence of EngineConfig
    interval_s : float
        Period between the starts of two rounds.
    timeout_s : float
        Timeout of one engine's scrape (connect, request and body).
    max_concurrency : int
        Most scrapes in flight at once.
    """

    def __init__(
        self,
        engines: Sequence[EngineConfig],
        *,
        interval_s: float = 1.0,
        timeout_s: float = 0.5,
        max_concurrency: int = 16,
    ) -> None:
        self.engines = tuple(engines)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.results: dict[str, EngineScrape] = {e.name: EngineScrape(e.name) for e in engines}
        self.rounds_total = 0
        self._session: aiohttp.ClientSession | None = None
        self._sem: asyncio.Semaphore | None = None

    async def _scrape(self, engine: EngineConfig) -> None:
        assert self._session is not None and self._sem is not None
        result = self.results[engine.name]
        result.scrapes_total += 1
        started = time.monotonic()
        try:
            async with self._sem, asyncio.timeout(self.timeout_s):
                headers = {"Authorization": f"Bearer {engine.api_key}"} if engine.api_key else {}
                async with self._session.get(engine.url + "/metrics", headers=headers) as resp:
                    if resp.status != 200:
                        raise MetricsParseError(f"/metrics answered HTTP {resp.status}")
                    data = await resp.content.read(MAX_METRICS_BYTES + 1)
            if len(data) > MAX_METRICS_BYTES:
                raise MetricsParseError(f"/metrics is over {MAX_METRICS_BYTES} bytes")
            duration = time.monotonic() - started
            by_model = await asyncio.to_thread(
                parse_vllm_metrics,
                data.decode("utf-8", errors="replace"),
                scraped_at_s=time.time(),
                scrape_duration_s=duration,
            )
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, TimeoutError, OSError, MetricsParseError) as exc:
            result.errors_total += 1
            text = (
                f"timeout after {self.timeout_s:g} s"
                if isinstance(exc, TimeoutError)
                else f"{type(exc).__name__}: {exc}"
            )
            if text != result.error:
                logger.info("scrape of engine %s failed: %s", engine.name, text)
            result.error = text
            return
        result.by_model = by_model
        result.signals = merge_signals(list(by_model.values()))
        result.error = None

    async def scrape_once(self) -> None:
        """One round: every engine, concurrently; returns when all are done or timed out."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_concurrency),
                timeout=aiohttp.ClientTimeout(total=None),
            )
            self._sem = asyncio.Semaphore(self.max_concurrency)
        await asyncio.gather(*(self._scrape(e) for e in self.engines))
        self.rounds_total += 1

    async def run(self) -> None:
        """Scrape forever (cancel to stop)."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                started = loop.time()
                try:
                    await self.scrape_once()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    logger.exception("engine scrape round failed")
                await asyncio.sleep(max(0.0, started + self.interval_s - loop.time()))
        finally:
            await self.close()

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None
