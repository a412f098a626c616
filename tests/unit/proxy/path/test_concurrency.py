"""ConcurrencyCaps: counts against caps, the availability mask, waking waiters."""

from __future__ import annotations

import asyncio

from fastroute.proxy.path.concurrency import ConcurrencyCaps


def test_caps_mask_and_version() -> None:
    """An engine leaves the mask at its cap and returns below it; uncapped never leave."""
    caps = ConcurrencyCaps([2, None])
    assert caps.enabled and caps.available.tolist() == [True, True]
    v0 = caps.version
    caps.started(0)
    caps.started(1)
    assert caps.available.tolist() == [True, True] and caps.version == v0
    caps.started(0)
    assert caps.available.tolist() == [False, True] and caps.version == v0 + 1
    assert caps.count(0) == 2 and caps.cap(0) == 2 and caps.cap(1) is None
    for _ in range(50):
        caps.started(1)
    assert caps.available.tolist() == [False, True]
    caps.finished(0)
    assert caps.available.tolist() == [True, True] and caps.version == v0 + 2
    assert not ConcurrencyCaps([None, None]).enabled


def test_wait_freed_wakes_on_release_and_times_out() -> None:
    """A waiter wakes when an engine leaves its cap; without that it times out."""

    async def main() -> None:
        caps = ConcurrencyCaps([1])
        caps.started(0)
        assert not await caps.wait_freed(0.01)
        assert not await caps.wait_freed(0.0)
        waiter = asyncio.create_task(caps.wait_freed(5.0))
        await asyncio.sleep(0)  # let it start waiting
        caps.finished(0)
        assert await waiter

    asyncio.run(asyncio.wait_for(main(), 10))
