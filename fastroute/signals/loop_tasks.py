"""The event loop's task count, a gauge the proxy and the controller both export."""

from __future__ import annotations

import asyncio

__all__ = ["loop_tasks"]


def loop_tasks() -> float:
    """Tasks of the running event loop; NaN when read off the loop (a test's thread).

    A steady climb over a long run is a leak (the soak fits its slope)."""
    try:
        return float(len(asyncio.all_tasks()))
    except RuntimeError:
        return float("nan")
