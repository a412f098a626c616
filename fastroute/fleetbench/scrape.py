"""Read counters from Prometheus ``/metrics`` pages: emulated engines and fastroute proxies.

Engine side (vLLM names, which the emulator exposes): requests finished
(``vllm:request_success_total``, all reasons), prefix-cache queries and hits in tokens
(``vllm:prefix_cache_{queries,hits}_total``), prompt and generation tokens. Proxy
side: retries and sheds (``fastroute_proxy_retries_total``,
``fastroute_proxy_shed_total``). A page that cannot be fetched gives None, never an
exception: a summary must still print when one server is gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import TypeVar

import aiohttp
import msgspec
from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "sum_samples",
    "EngineCounters",
    "ProxyCounters",
    "scrape_engines",
    "scrape_proxies",
    "fetch_json",
]

C = TypeVar("C")


def sum_samples(text: str) -> dict[str, float]:
    """Σ of every sample, per sample name (labels summed over), from exposition text."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


class EngineCounters(msgspec.Struct, kw_only=True):
    """Cumulative counters of one engine at scrape time."""

    requests: float
    prefix_queries_tokens: float
    prefix_hits_tokens: float
    prompt_tokens: float
    generation_tokens: float

    def minus(self, before: EngineCounters | None) -> EngineCounters:
        """The increase since ``before`` (itself if None)."""
        if before is None:
            return self
        return EngineCounters(
            requests=self.requests - before.requests,
            prefix_queries_tokens=self.prefix_queries_tokens - before.prefix_queries_tokens,
            prefix_hits_tokens=self.prefix_hits_tokens - before.prefix_hits_tokens,
            prompt_tokens=self.prompt_tokens - before.prompt_tokens,
            generation_tokens=self.generation_tokens - before.generation_tokens,
        )

    @property
    def hit_rate(self) -> float | None:
        """Prefix-cache hit rate in tokens (hits / queries); None before any query."""
        q = self.prefix_queries_tokens
        return self.prefix_hits_tokens / q if q > 0 else None


class ProxyCounters(msgspec.Struct, kw_only=True):
    """Cumulative counters of one fastroute proxy at scrape time."""

    retries: float
    retry_refused: float
    shed: float


async def _fetch(http: aiohttp.ClientSession, url: str) -> str | None:
    try:
        async with http.get(url.rstrip("/") + "/metrics") as resp:
            if resp.status != 200:
                return None
            return await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return None


async def _scrape_all(urls: Mapping[str, str], timeout_s: float) -> dict[str, dict[str, float]]:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        texts = await asyncio.gather(*(_fetch(http, u) for u in urls.values()))
    out = {}
    for name, text in zip(urls, texts, strict=True):
        if text is not None:
            try:
                out[name] = sum_samples(text)
            except ValueError:
                continue  # unparsable page: treated as unavailable
    return out


async def _counters(
    urls: Mapping[str, str], timeout_s: float, build: Callable[[dict[str, float]], C]
) -> dict[str, C | None]:
    """``build`` applied to each server's summed samples; None for a server that did not answer."""
    pages = await _scrape_all(urls, timeout_s)
    return {name: None if name not in pages else build(pages[name]) for name in urls}


def _engine_counters(s: dict[str, float]) -> EngineCounters:
    return EngineCounters(
        requests=s.get("vllm:request_success_total", 0.0),
        prefix_queries_tokens=s.get("vllm:prefix_cache_queries_total", 0.0),
        prefix_hits_tokens=s.get("vllm:prefix_cache_hits_total", 0.0),
        prompt_tokens=s.get("vllm:prompt_tokens_total", 0.0),
        generation_tokens=s.get("vllm:generation_tokens_total", 0.0),
    )


def _proxy_counters(s: dict[str, float]) -> ProxyCounters:
    return ProxyCounters(
        retries=s.get("fastroute_proxy_retries_total", 0.0),
        retry_refused=s.get("fastroute_proxy_retry_refused_total", 0.0),
        shed=s.get("fastroute_proxy_shed_total", 0.0),
    )


async def scrape_engines(
    urls: Mapping[str, str], timeout_s: float = 5.0
) -> dict[str, EngineCounters | None]:
    """Counters of each engine (name → URL); None for an engine that did not answer."""
    return await _counters(urls, timeout_s, _engine_counters)


async def scrape_proxies(
    urls: Mapping[str, str], timeout_s: float = 5.0
) -> dict[str, ProxyCounters | None]:
    """Retry and shed counters of each fastroute proxy; None for one that did not answer."""
    return await _counters(urls, timeout_s, _proxy_counters)


async def fetch_json(url: str, timeout_s: float = 5.0) -> object | None:
    """``GET url`` as JSON; None when it cannot be fetched or parsed."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as http, http.get(url) as resp:
            if resp.status != 200:
                return None
            return msgspec.json.decode(await resp.read())
    except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError):
        return None
