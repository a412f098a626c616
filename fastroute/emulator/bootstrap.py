"""SGLang's P/D bootstrap, prefill side: which ``bootstrap_room`` has its KV ready.

An SGLang router sends the same request to a prefill and a decode engine at once, with
a shared random ``bootstrap_room``. The decode engine asks the prefill engine's bootstrap
server (``bootstrap_host:bootstrap_port``) for the room's KV and cannot start before the
prefill of that room has finished. :class:`BootstrapRooms` is that rendezvous: the
prefill handler marks a room held, the bootstrap endpoint waits for it, bounded by the
decode's timeout. A prefill that fails marks nothing: as with SGLang, its decode waits
for KV that never comes (until the timeout, or until the router cancels it).
"""

from __future__ import annotations

import asyncio

__all__ = ["BootstrapRooms", "RoomFailed", "MAX_ROOMS", "DEFAULT_BOOTSTRAP_TIMEOUT_S"]

#: How long an SGLang decode engine waits for the prefill of its ``bootstrap_room``.
DEFAULT_BOOTSTRAP_TIMEOUT_S = 30.0

#: Rooms remembered at once (held and never asked for, or waited for and not yet
#: prefilled); the oldest settled ones go first beyond it.
MAX_ROOMS = 65536


class RoomFailed(Exception):
    """No prefill of the room finished within the wait."""


class BootstrapRooms:
    """The rooms of one prefill engine: the request id whose KV is held for each."""

    def __init__(self, max_rooms: int = MAX_ROOMS) -> None:
        self.max_rooms = max_rooms
        self._rooms: dict[int, asyncio.Future[str]] = {}

    def __len__(self) -> int:
        return len(self._rooms)

    @property
    def waiting(self) -> int:
        """Rooms a decode engine waits for whose prefill has not finished yet."""
        return sum(1 for fut in self._rooms.values() if not fut.done())

    def _future(self, room: int) -> asyncio.Future[str]:
        fut = self._rooms.get(room)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._rooms[room] = fut
            self._evict()
        return fut

    def _evict(self) -> None:
        """Forget the oldest settled rooms beyond the bound (no waiter is dropped)."""
        excess = len(self._rooms) - self.max_rooms
        for room in [r for r, f in self._rooms.items() if f.done()][: max(0, excess)]:
            del self._rooms[room]

    def held(self, room: int, request_id: str) -> None:
        """The prefill of ``room`` finished: its KV is held as ``request_id``."""
        fut = self._future(room)
        if not fut.done():
            fut.set_result(request_id)

    async def wait(self, room: int, timeout_s: float) -> str:
        """The request id whose KV ``room`` names, once its prefill finished.

        Raises
        ------
        RoomFailed
            No prefill of ``room`` finished within ``timeout_s``.
        """
        fut = self._future(room)
        try:
            async with asyncio.timeout(timeout_s):
                request_id = await asyncio.shield(fut)
        except TimeoutError:
            raise RoomFailed(
                f"no prefill of bootstrap_room {room} finished within {timeout_s:g} s"
            ) from None
        finally:
            self._rooms.pop(room, None)  # one decode per room
        return request_id
