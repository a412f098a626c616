"""Bounded polling for tests: wait for a condition, fail after a deadline (never sleep blindly)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

__all__ = ["wait_until"]


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
