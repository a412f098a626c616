"""Optional engine scraping by the proxy itself (``proxy.scrape_engines``; off by default).

Normally the controller scrapes engines. Without one, the proxy runs the shared scraper
(:class:`fastroute.signals.scrape.EngineScraper`, ``/metrics`` only): every engine every
``scrape_interval_s``, all engines concurrently (at most ``max_concurrency`` at once), each
scrape bounded by ``scrape_timeout_s``. Results (:class:`EngineScrape`: the parsed
:class:`~fastroute.signals.vllm.EngineSignals`, their age, the last error) are kept per engine
name in :attr:`EngineScraper.results`; the proxy uses them as they are, for its ``/metrics``
(:mod:`fastroute.proxy.background.signal_tasks`) and the marginal-cost engine load
(:mod:`fastroute.proxy.path.engine_load`). A failed scrape keeps the last good signals (their age
grows).

Routing never waits on a scrape: the scraper is a background task on its own HTTP
session and connection pool (not the upstream pool), and parsing runs in a thread.
"""

from __future__ import annotations

from fastroute.signals.scrape import MAX_METRICS_BYTES, EngineScrape, EngineScraper

__all__ = ["EngineScrape", "EngineScraper", "MAX_METRICS_BYTES"]
