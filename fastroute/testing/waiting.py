"""Bounded polling for tests: wait for a condition, fail after a deadline (never sleep blindly)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

__all__ = ["poll_until", "wait_until"]


async def wait_until(
    predicate: Callable[[], bool | Awaitable[bool]], timeout: float = 5.0, interval: float = 0.01
) -> None:
    """Poll ``predicate`` (sync or async) until it is true.

    Raises
    ------
    AssertionError
        The condition did not hold within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(interval)


def poll_until(
    predicate: Callable[[], bool], what: str, timeout: float = 30.0, interval: float = 0.05
) -> None:
    """Blocking :func:`wait_until` for synchronous tests (``what`` names the condition).

    Raises
    ------
    AssertionError
        The condition did not hold within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)
