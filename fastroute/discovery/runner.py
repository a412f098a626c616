"""Re-resolve the ``[[discovery]]`` names on a schedule, once per host, off the caller's thread.

:class:`DiscoveryRunner` runs one asyncio task per ``[[discovery]]`` section on an event
loop in a thread of its own (the ``fastroute serve`` supervisor is a synchronous signal
loop). Each task resolves its name every ``interval_s``, records the outcome in the
engines state file (the address set on success; the failure count and message on
failure, keeping the last set) and, when the set changed, calls ``on_change`` so the
change goes through the ordinary reload path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from fastroute.config import ConfigError, DiscoveryConfig
from fastroute.discovery.dns import ResolveError, resolve
from fastroute.discovery.state_file import (
    Address,
    DiscoveryStatus,
    EngineState,
    update_state,
    with_discovery,
)

__all__ = ["DiscoveryRunner", "record_resolution", "STOP_TIMEOUT_S"]

logger = logging.getLogger(__name__)

#: How long :meth:`DiscoveryRunner.stop` waits for the thread, seconds.
STOP_TIMEOUT_S = 5.0


def record_resolution(
    path: Path, disc: DiscoveryConfig, result: tuple[Address, ...] | ResolveError
) -> bool:
    """Write one resolution's outcome to the state file; True if the address set changed."""
    changed = False

    def change(state: EngineState) -> EngineState:
        nonlocal changed
        old = state.discovery.get(disc.name, DiscoveryStatus())
        if isinstance(result, ResolveError):
            status = DiscoveryStatus(old.addresses, old.failures + 1, str(result), old.resolved_at)
        else:
            changed = result != old.addresses
            status = DiscoveryStatus(result, old.failures, old.last_error, time.time())
        return with_discovery(state, disc.name, status)

    update_state(path, change)
    return changed


class DiscoveryRunner:
    """Resolve ``discoveries`` every ``interval_s`` in a background thread.

    Parameters
    ----------
    discoveries : sequence of DiscoveryConfig
        The ``[[discovery]]`` sections.
    state_path : Path
        The engines state file the results go to.
    on_change : callable
        Called (in the runner's thread) after a name's address set changed in the file.
    """

    def __init__(
        self,
        discoveries: Sequence[DiscoveryConfig],
        state_path: Path,
        on_change: Callable[[], None],
    ) -> None:
        self.discoveries = tuple(discoveries)
        self.state_path = state_path
        self.on_change = on_change
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()

    def start(self) -> None:
        """Start the thread (no-op without discoveries)."""
        if not self.discoveries or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._main, name="fastroute-discovery", daemon=True)
        self._thread.start()
        self._started.wait(STOP_TIMEOUT_S)

    def stop(self) -> None:
        """Stop the tasks and join the thread (bounded by :data:`STOP_TIMEOUT_S`)."""
        if self._thread is None:
            return
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already closed
                loop.call_soon_threadsafe(stop.set)
        self._thread.join(STOP_TIMEOUT_S)
        self._thread = None

    def _main(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._started.set()
        tasks = [asyncio.create_task(self._follow(d)) for d in self.discoveries]
        await self._stop.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _follow(self, disc: DiscoveryConfig) -> None:
        assert self._stop is not None
        while not self._stop.is_set():
            try:
                await self.resolve_once(disc)
            except Exception:  # a bug must not end discovery for the proxy's lifetime
                logger.exception("discovery %r: resolution failed unexpectedly", disc.name)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), disc.interval_s)

    async def resolve_once(self, disc: DiscoveryConfig) -> bool:
        """Resolve ``disc`` once and record it; True if its address set changed."""
        try:
            result: tuple[Address, ...] | ResolveError = await resolve(disc)
        except ResolveError as exc:
            logger.warning("discovery %r: %s (keeping the last address set)", disc.name, exc)
            result = exc
        try:
            changed = await asyncio.to_thread(record_resolution, self.state_path, disc, result)
        except (ConfigError, OSError) as exc:
            logger.error("discovery %r: cannot update %s: %s", disc.name, self.state_path, exc)
            return False
        if changed:
            logger.info("discovery %r: %d engines now", disc.name, len(result))  # type: ignore[arg-type]
            self.on_change()
        return changed
