"""Scrape engines' ``/metrics`` (and ``/health``) in rounds: the machinery every scraper shares.

:class:`EngineScraper` fetches every engine's ``/metrics`` (and, with ``health=True``, its
``/health``) concurrently, at most ``max_concurrency`` engines at once, each engine bounded by
``timeout_s`` (requests, body read and parsing) and its body by :data:`MAX_METRICS_BYTES`. The text
is parsed by :func:`~fastroute.signals.vllm.parse_engine_metrics` in the dialect of the engine's
kind (``engines[].kind``: vLLM, SGLang, llama.cpp; an ``openai`` engine's ``/metrics`` is not
fetched) in a thread, so the event loop never waits on it. :meth:`EngineScraper.run` repeats a
round every ``interval_s`` until cancelled; the scraper has its own HTTP session and pool.

What the rounds say about one engine is kept in its :class:`EngineScrape`: the last good signals
(with their timestamp, so their age), ``/health``, the last error and counters. A failed scrape
keeps the last good signals (their age grows). So does a scrape that finds no metric of the
engine's dialect: it is no signal (an error: is the kind right?), never an empty one. An engine
whose ``/metrics`` answers 404 or 501 has its metrics turned off: that is said once, with the
flag that turns them on, and is not counted as a failed scrape. Users that do more with each good
scrape pass a subclass whose :meth:`EngineScrape.absorb` does it (the controller's windows,
:mod:`controller.scrape`); the proxy reads the results as they are
(:mod:`fastroute.proxy.background.scraper`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import aiohttp

from fastroute.signals.body import read_bounded
from fastroute.signals.dialects import dialect_for
from fastroute.signals.prefix_cache import PrefixHitTracker
from fastroute.signals.vllm import (
    EngineSignals,
    MetricsParseError,
    merge_signals,
    parse_engine_metrics,
)

__all__ = [
    "MAX_HEALTH_BYTES",
    "MAX_METRICS_BYTES",
    "EngineScrape",
    "EngineScraper",
    "ScrapeTarget",
]

log = logging.getLogger(__name__)

#: Largest ``/metrics`` body read.
MAX_METRICS_BYTES = 8 * 1024 * 1024
#: Largest ``/health`` body read.
MAX_HEALTH_BYTES = 64 * 1024
#: ``/metrics`` statuses that mean "the engine's metrics are turned off", not a failure.
METRICS_DISABLED_STATUSES = frozenset({404, 501})


class _MetricsDisabled(Exception):
    """``/metrics`` answered one of :data:`METRICS_DISABLED_STATUSES`."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class ScrapeTarget(Protocol):
    """An engine to scrape (``fastroute.config.EngineConfig`` is one)."""

    @property
    def name(self) -> str:
        """Engine name, unique among the targets."""
        ...

    @property
    def url(self) -> str:
        """Server root, ``http://host:port``."""
        ...

    @property
    def api_key(self) -> str | None:
        """Bearer token sent with each request, if any."""
        ...

    @property
    def kind(self) -> str:
        """Engine kind, the dialect of its ``/metrics`` (:mod:`fastroute.signals.dialects`)."""
        ...


@dataclass(slots=True)
class EngineScrape:
    """What the scrapes of one engine say.

    Attributes
    ----------
    engine : str
        Engine name.
    signals : EngineSignals or None
        Engine-wide signals of the last good ``/metrics`` scrape (models merged).
    by_model : dict of str to EngineSignals or None
        The same per ``model_name``.
    healthy : bool or None
        ``/health`` answered 200 at the last scrape that asked (None: never answered).
    error : str or None
        The last scrape's error; None if it succeeded.
    metrics_disabled : bool
        The last scrape found the engine's metrics turned off (``/metrics`` answered 404 or 501).
    scrapes_total, errors_total : int
        Scrapes attempted and failed.
    prefix_hits : PrefixHitTracker
        The engine's prefix-cache hit rate over the last minute of good scrapes
        (``prefix_hits.current``; :mod:`fastroute.signals.prefix_cache`).
    """

    engine: str
    signals: EngineSignals | None = None
    by_model: dict[str, EngineSignals] | None = None
    healthy: bool | None = None
    error: str | None = None
    metrics_disabled: bool = False
    scrapes_total: int = 0
    errors_total: int = 0
    prefix_hits: PrefixHitTracker = field(default_factory=PrefixHitTracker)

    def age_s(self, now_s: float | None = None) -> float | None:
        """Seconds since the last good scrape (``now_s`` default: the wall clock); None if none."""
        if self.signals is None:
            return None
        return max(0.0, (time.time() if now_s is None else now_s) - self.signals.scraped_at_s)

    def absorb(self, by_model: dict[str, EngineSignals]) -> None:
        """Keep a good scrape (``model_name`` → signals) and clear the error."""
        self.by_model = by_model
        self.signals = merge_signals(list(by_model.values()))
        self.prefix_hits.update(self.signals)
        self.error = None


R = TypeVar("R", bound=EngineScrape)


class EngineScraper(Generic[R]):
    """Scrape a set of engines in rounds (see module doc).

    Parameters
    ----------
    engines : sequence of ScrapeTarget
        Engines with unique names.
    interval_s : float
        Period between the starts of two rounds (:meth:`run`).
    timeout_s : float
        Bound on one engine's scrape: requests, body read and parsing.
    max_concurrency : int
        Engines scraped at once.
    health : bool
        Also fetch ``/health`` (with ``/metrics``, within the same timeout).
    new_result : callable
        Makes the :class:`EngineScrape` (or subclass) of an engine from its name.
    clock : callable
        Unix seconds, stamped on each scrape's signals (``scraped_at_s``).

    Attributes
    ----------
    results : dict of str to EngineScrape
        Per engine name, in the order of ``engines``.
    rounds_total : int
        Completed rounds.
    """

    def __init__(
        self,
        engines: Sequence[ScrapeTarget],
        *,
        interval_s: float = 1.0,
        timeout_s: float = 0.5,
        max_concurrency: int = 16,
        health: bool = False,
        new_result: Callable[[str], R] = EngineScrape,  # type: ignore[assignment]
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not (interval_s > 0 and timeout_s > 0 and max_concurrency >= 1):
            raise ValueError(
                f"scraper needs interval_s > 0, timeout_s > 0 and max_concurrency >= 1, got "
                f"{interval_s!r}, {timeout_s!r}, {max_concurrency!r}"
            )
        self.engines = tuple(engines)
        names = [e.name for e in self.engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique to scrape them, got {names}")
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.health = health
        self.clock = clock
        self.results: dict[str, R] = {name: new_result(name) for name in names}
        self.rounds_total = 0
        self._session: aiohttp.ClientSession | None = None
        self._sem: asyncio.Semaphore | None = None

    async def _get(self, engine: ScrapeTarget, path: str, limit: int) -> tuple[int, bytes]:
        assert self._session is not None
        headers = {"Authorization": f"Bearer {engine.api_key}"} if engine.api_key else {}
        async with self._session.get(engine.url + path, headers=headers) as resp:
            return resp.status, await read_bounded(resp.content, limit)

    async def _fetch(self, engine: ScrapeTarget, result: R) -> dict[str, EngineSignals]:
        started = time.monotonic()
        dialect = dialect_for(engine.kind)
        gets = []
        if dialect.has_metrics:
            gets.append(self._get(engine, "/metrics", MAX_METRICS_BYTES))
        if self.health:
            gets.append(self._get(engine, "/health", MAX_HEALTH_BYTES))
        answers = await asyncio.gather(*gets)
        if self.health:
            result.healthy = answers.pop()[0] == 200
        if not dialect.has_metrics:
            return {}
        status, body = answers[0]
        if status in METRICS_DISABLED_STATUSES:
            raise _MetricsDisabled(status)
        if status != 200:
            raise MetricsParseError(f"/metrics answered HTTP {status}")
        if len(body) > MAX_METRICS_BYTES:
            raise MetricsParseError(f"/metrics is over {MAX_METRICS_BYTES} bytes")
        by_model = await asyncio.to_thread(
            parse_engine_metrics,
            body.decode("utf-8", errors="replace"),
            dialect.kind,
            scraped_at_s=self.clock(),
            scrape_duration_s=time.monotonic() - started,
        )
        if not by_model:
            raise MetricsParseError(
                f"/metrics has no {dialect.kind} metric (is engines[].kind right?)"
            )
        return by_model

    def _fail(self, engine: ScrapeTarget, result: R, text: str) -> None:
        result.errors_total += 1
        if text != result.error:  # log changes, not every failed round
            log.info("scrape of engine %s failed: %s", engine.name, text)
        result.error = text

    def _disabled(self, engine: ScrapeTarget, result: R, status: int) -> None:
        if not result.metrics_disabled:  # said once, not every round
            log.warning(
                "engine %s has its metrics turned off (/metrics answered HTTP %d): %s; "
                "routing goes on without its load signals",
                engine.name,
                status,
                dialect_for(engine.kind).enable_hint,
            )
        result.metrics_disabled = True
        result.error = None

    async def _scrape(self, engine: ScrapeTarget, result: R) -> None:
        assert self._sem is not None
        result.scrapes_total += 1
        try:
            async with self._sem, asyncio.timeout(self.timeout_s):
                by_model = await self._fetch(engine, result)
        except asyncio.CancelledError:
            raise
        except _MetricsDisabled as exc:
            self._disabled(engine, result, exc.status)
            return
        except TimeoutError:
            self._fail(engine, result, f"timeout after {self.timeout_s:g} s")
            return
        except (aiohttp.ClientError, OSError, MetricsParseError) as exc:
            self._fail(engine, result, f"{type(exc).__name__}: {exc}")
            return
        result.metrics_disabled = False
        if by_model:
            result.absorb(by_model)
        else:  # a kind without metrics: nothing to keep, nothing wrong
            result.error = None

    async def scrape_once(self) -> None:
        """One round over every engine; returns when each has answered or timed out."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_concurrency),
                timeout=aiohttp.ClientTimeout(total=None),  # bounded per engine by timeout_s
            )
            self._sem = asyncio.Semaphore(self.max_concurrency)
        await asyncio.gather(
            *(self._scrape(e, r) for e, r in zip(self.engines, self.results.values(), strict=True))
        )
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
        """Close the HTTP session (a later round opens a new one)."""
        if self._session is not None:
            await self._session.close()
            self._session = None
