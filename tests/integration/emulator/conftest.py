"""Helpers for emulator HTTP tests: bounded asyncio runs, bounded polling, SSE reading.

Tests drive their own event loop with ``asyncio.run`` (no pytest-asyncio); every
wait has a bound.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fastroute.testing import waiting

RUN_TIMEOUT_S = 60.0


def _run(coro: Coroutine[Any, Any, Any], timeout: float = RUN_TIMEOUT_S) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def _read_sse(resp: aiohttp.ClientResponse) -> tuple[list[dict], list[float], bool]:
    """Read an SSE body: (events before [DONE], arrival time of each, saw [DONE])."""
    events, times, done = [], [], False
    async for raw in resp.content:
        line = raw.strip()
        if not line:
            continue
        assert line.startswith(b"data: "), line
        if line == b"data: [DONE]":
            done = True
            break
        events.append(json.loads(line[6:]))
        times.append(time.perf_counter())
    return events, times, done


async def _scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Scrape /metrics into {sample name + sorted labels: value}."""
    async with session.get(url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine")
            )
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


@pytest.fixture
def arun() -> Callable[..., Any]:
    """Run a coroutine on a fresh event loop, bounded by a timeout (default 60 s)."""
    return _run


@pytest.fixture
def wait_until() -> Callable[..., Awaitable[None]]:
    """Poll a (sync or async) predicate until true; fail after ``timeout`` seconds."""
    return lambda predicate, timeout=10.0, interval=0.01: waiting.wait_until(
        predicate, timeout, interval
    )


@pytest.fixture
def read_sse() -> Callable[
    [aiohttp.ClientResponse], Awaitable[tuple[list[dict], list[float], bool]]
]:
    """Read an SSE response into parsed events, their arrival times and the [DONE] flag."""
    return _read_sse


@pytest.fixture
def scrape() -> Callable[[aiohttp.ClientSession, str], Awaitable[dict[str, float]]]:
    """Scrape an engine's /metrics into a flat {name{labels}: value} dict."""
    return _scrape
