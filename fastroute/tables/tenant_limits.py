"""Per-tenant rate and concurrency counters shared by every worker process of one host.

One slot per configured tenant (the count is fixed at creation from the config), each
holding a ring of :data:`WINDOWS` sub-windows of ``60 / WINDOWS`` seconds with request
and token counts, and an in-flight counter. Updated with the compiled core's atomic
adds (``fastroute._core.AtomicBuffer``), so all workers of a proxy enforce one limit.

The limit is a sliding minute at sub-window granularity: a request is admitted when
the counts of the last ``WINDOWS`` sub-windows plus its cost stay within the per-minute
share. Admission reserves by adding first and takes the add back when it overshoots,
so two workers racing for the last unit cannot both get it. Reusing a ring slot for a
new sub-window stores its tag and zeroes its counts; an add from another worker in the
same instant can be lost (at most one request per worker per sub-window boundary),
which is the price of having no compare-and-swap.

Time is ``CLOCK_MONOTONIC`` (``time.monotonic``), common to every process of the host.
"""

from __future__ import annotations

import math
import os
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastroute._core import AtomicBuffer
from fastroute.errors import TableFormatError, TableSizeError, TableValueError
from fastroute.tables.segment import (
    WriterLock,
    close_mapping,
    create_segment,
    map_segment,
    open_existing,
    segment_path,
)

__all__ = [
    "TenantLimitBlock",
    "Charge",
    "SlotLimits",
    "Usage",
    "WINDOWS",
    "WINDOW_S",
    "MAX_TENANTS",
]

#: Sub-windows of the sliding minute: 10 of 6 s, so the minute slides in 6 s steps and
#: an admission reads 20 words (cheap next to parsing the request).
WINDOWS = 10
#: Length of one sub-window, seconds.
WINDOW_S = 60.0 / WINDOWS
#: Tenants a block holds at most (bounds the segment: 320 bytes per tenant).
MAX_TENANTS = 4096

_MAGIC = 0x5354_4E41_4E54_5246  # "FRTNANTS"-ish, little-endian tag of a valid block
_VERSION = 1
_HEADER = struct.Struct("<QII")  # magic, version, n_tenants
_HEADER_SIZE = 64
_SLOT_SIZE = 320  # 3 words per sub-window + in-flight, padded to whole cache lines
_IN_FLIGHT = 8 * 3 * WINDOWS


def tenant_block_name(stats_name: str) -> str:
    """The segment name of the tenant block that goes with stats block ``stats_name``."""
    return f"{stats_name}.tenants"


def _window_no(now_s: float) -> int:
    return int(now_s // WINDOW_S)


@dataclass(frozen=True, slots=True)
class Charge:
    """What one admission took from a tenant's slot, to give back or correct later.

    Attributes
    ----------
    slot : int
        The tenant's slot.
    window_no : int
        The sub-window the request and its tokens were counted in.
    tokens : int
        The tokens charged (the estimate).
    concurrent : bool
        Whether an in-flight unit was taken (released by :meth:`TenantLimitBlock.finish`).
    """

    slot: int
    window_no: int
    tokens: int
    concurrent: bool


@dataclass(frozen=True, slots=True)
class Usage:
    """A tenant's use of its slot over the sliding minute (for the ``x-ratelimit`` headers).

    Attributes
    ----------
    requests, tokens : int
        Requests and tokens counted in the last minute.
    in_flight : int
        Requests in flight now.
    oldest_window_s : float
        Seconds until the oldest non-empty sub-window leaves the minute (0 if none).
    """

    requests: int
    tokens: int
    in_flight: int
    oldest_window_s: float


class TenantLimitBlock:
    """A shared-memory block of per-tenant sliding-minute counters.

    Use :meth:`create` once per host (the supervisor) and :meth:`attach` in each worker.
    The limits themselves are not stored: each worker passes its current share (from
    the controller's table, or the configured split) to :meth:`admit`.
    """

    def __init__(self, name: str, path: Path, fd: int, mm: Any, n_tenants: int) -> None:
        self.name = name
        self.path = path
        self.n_tenants = n_tenants
        self._fd = fd
        self._mm = mm
        self._lock: WriterLock | None = None
        self._atomic = AtomicBuffer(mm, writable=True, lock_fd=fd)

    @staticmethod
    def segment_size(n_tenants: int) -> int:
        """Bytes of a block for ``n_tenants`` tenants."""
        return _HEADER_SIZE + _SLOT_SIZE * n_tenants

    @classmethod
    def create(cls, name: str, n_tenants: int, *, mode: int = 0o600) -> TenantLimitBlock:
        """Create a fresh, zeroed block of ``n_tenants`` slots (replacing any old one).

        Raises
        ------
        fastroute.errors.TableLockedError
            Another live process owns the name.
        fastroute.errors.TableValueError
            ``n_tenants`` is not in 1..``MAX_TENANTS``.
        """
        if not 1 <= n_tenants <= MAX_TENANTS:
            raise TableValueError(f"n_tenants must be in 1..{MAX_TENANTS}, got {n_tenants}")

        def write_header(mm: Any) -> None:
            _HEADER.pack_into(mm, 0, 0, _VERSION, n_tenants)
            mm[0:8] = _MAGIC.to_bytes(8, "little")  # magic last: now valid

        path = segment_path(name)
        fd, mm, lock = create_segment(name, cls.segment_size(n_tenants), write_header, mode=mode)
        block = cls(name, path, fd, mm, n_tenants)
        block._lock = lock
        return block

    @classmethod
    def private(cls, n_tenants: int) -> TenantLimitBlock:
        """A block of this process alone (an unnamed, already unlinked file): the
        workers' fallback when the host's block cannot be attached."""
        if not 1 <= n_tenants <= MAX_TENANTS:
            raise TableValueError(f"n_tenants must be in 1..{MAX_TENANTS}, got {n_tenants}")
        fd, path = tempfile.mkstemp(prefix="fastroute-tenants-")
        os.unlink(path)
        size = cls.segment_size(n_tenants)
        os.ftruncate(fd, size)
        mm = map_segment(fd, size, writable=True)
        _HEADER.pack_into(mm, 0, _MAGIC, _VERSION, n_tenants)
        return cls("", Path(path), fd, mm, n_tenants)

    @classmethod
    def attach(cls, name: str) -> TenantLimitBlock:
        """Attach to an existing block (any number of processes).

        Raises
        ------
        fastroute.errors.TableNotFoundError, TableSizeError, TableFormatError
            No such block, a truncated one, or not a tenant block of this version.
        """
        path = segment_path(name)
        fd = open_existing(path, writable=True)
        try:
            size = os.fstat(fd).st_size
            if size < _HEADER_SIZE:
                raise TableSizeError(
                    f"tenant block {name!r} is {size} bytes, shorter than its header"
                )
            mm = map_segment(fd, size, writable=True)
            magic, version, n_tenants = _HEADER.unpack_from(mm, 0)
            if magic != _MAGIC or version != _VERSION:
                close_mapping(mm)
                raise TableFormatError(f"{name!r} is not a version-{_VERSION} tenant block")
            if size < cls.segment_size(n_tenants):
                close_mapping(mm)
                raise TableSizeError(f"tenant block {name!r} is truncated ({size} bytes)")
        except BaseException:
            os.close(fd)
            raise
        return cls(name, path, fd, mm, n_tenants)

    def close(self, *, unlink: bool = False) -> None:
        """Detach; the creator may ``unlink`` the segment."""
        if self._fd < 0:
            return
        self._atomic.release()
        close_mapping(self._mm)
        os.close(self._fd)
        self._fd = -1
        if self._lock is not None:
            if unlink:
                self.path.unlink(missing_ok=True)
            self._lock.release(unlink=unlink)

    # -- counting ------------------------------------------------------------------

    def _word(self, slot: int, window_no: int, field: int) -> int:
        return _HEADER_SIZE + slot * _SLOT_SIZE + 8 * (3 * (window_no % WINDOWS) + field)

    def _current(self, slot: int, window_no: int) -> None:
        """Make the ring slot of ``window_no`` count for it (reset it if it held an older one)."""
        a = self._atomic
        tag_at = self._word(slot, window_no, 0)
        if a.load_i64(tag_at) != window_no + 1:  # tags are window_no + 1: 0 means never used
            a.store_u64(tag_at, window_no + 1)
            a.store_u64(tag_at + 8, 0)
            a.store_u64(tag_at + 16, 0)

    def _earlier(self, slot: int, now_w: int) -> tuple[int, int, int | None]:
        """Requests and tokens of the minute's sub-windows before ``now_w``, and the
        oldest of them with requests (None if none)."""
        a = self._atomic
        requests = tokens = 0
        oldest = None
        for w in range(now_w - WINDOWS + 1, now_w):
            at = self._word(slot, w, 0)
            if a.load_i64(at) == w + 1:
                r = a.load_i64(at + 8)
                requests += r
                tokens += a.load_i64(at + 16)
                if oldest is None and r > 0:
                    oldest = w
        return requests, tokens, oldest

    def usage(self, slot: int, now_s: float | None = None) -> Usage:
        """The slot's requests and tokens in the sliding minute ending at ``now_s``."""
        self._check(slot)
        now_s = time.monotonic() if now_s is None else now_s
        a, now_w = self._atomic, _window_no(now_s)
        requests, tokens, oldest = self._earlier(slot, now_w)
        at = self._word(slot, now_w, 0)
        if a.load_i64(at) == now_w + 1:
            r = a.load_i64(at + 8)
            requests += r
            tokens += a.load_i64(at + 16)
            if oldest is None and r > 0:
                oldest = now_w
        in_flight = a.load_i64(_HEADER_SIZE + slot * _SLOT_SIZE + _IN_FLIGHT)
        leaves_s = 0.0 if oldest is None else (oldest + WINDOWS) * WINDOW_S - now_s
        return Usage(requests, tokens, in_flight, max(0.0, leaves_s))

    def admit(
        self, slot: int, tokens: int, limits: SlotLimits, now_s: float | None = None
    ) -> Charge | str:
        """Count one request of ``tokens`` estimated tokens if the tenant's share allows it.

        Parameters
        ----------
        slot : int
            The tenant's slot.
        tokens : int
            Estimated prompt + output tokens (>= 0).
        limits : SlotLimits
            This proxy's current share of the tenant's limits.
        now_s : float, optional
            ``time.monotonic()`` by default (tests pass a clock).

        Returns
        -------
        Charge or str
            The charge to :meth:`finish` later, or the name of the limit that refused
            (``"requests"``, ``"tokens"`` or ``"concurrent"``).
        """
        self._check(slot)
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        now_s = time.monotonic() if now_s is None else now_s
        a, now_w = self._atomic, _window_no(now_s)
        self._current(slot, now_w)
        at = self._word(slot, now_w, 0)
        rpm, tpm = limits.requests_per_min, limits.tokens_per_min
        earlier_req, earlier_tok, _ = (
            self._earlier(slot, now_w) if rpm is not None or tpm is not None else (0, 0, None)
        )
        # Reserve first, then check: of two workers racing for the last unit one sees
        # the other's add and takes its own back.
        if a.add_i64(at + 8, 1) + earlier_req > (math.inf if rpm is None else rpm):
            a.add_i64(at + 8, -1)
            return "requests"
        if tokens and a.add_i64(at + 16, tokens) + earlier_tok > (math.inf if tpm is None else tpm):
            a.add_i64(at + 16, -tokens)
            a.add_i64(at + 8, -1)
            return "tokens"
        concurrent = limits.max_concurrent is not None
        if concurrent:
            flight_at = _HEADER_SIZE + slot * _SLOT_SIZE + _IN_FLIGHT
            if a.add_i64(flight_at, 1) > limits.max_concurrent:
                a.add_i64(flight_at, -1)
                a.add_i64(at + 16, -tokens)
                a.add_i64(at + 8, -1)
                return "concurrent"
        return Charge(slot, now_w, tokens, concurrent)

    def finish(
        self, charge: Charge, used_tokens: int | None = None, now_s: float | None = None
    ) -> None:
        """Release a request's in-flight unit and correct its tokens to the engine's usage.

        Parameters
        ----------
        charge : Charge
            What :meth:`admit` returned.
        used_tokens : int, optional
            Prompt + completion tokens the engine reported; None keeps the estimate.
        now_s : float, optional
            The clock (tests).
        """
        a = self._atomic
        if charge.concurrent:
            a.add_i64(_HEADER_SIZE + charge.slot * _SLOT_SIZE + _IN_FLIGHT, -1)
        if used_tokens is None or used_tokens == charge.tokens:
            return
        delta = int(used_tokens) - charge.tokens
        now_w = _window_no(time.monotonic() if now_s is None else now_s)
        at = self._word(charge.slot, charge.window_no, 0)
        if now_w - charge.window_no < WINDOWS and a.load_i64(at) == charge.window_no + 1:
            a.add_i64(at + 16, delta)  # still in the minute: correct the window it was charged to
        elif delta > 0:  # the charge left the minute: a refund is moot, an overuse counts now
            self._current(charge.slot, now_w)
            a.add_i64(self._word(charge.slot, now_w, 0) + 16, delta)

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.n_tenants:
            raise IndexError(f"tenant slot {slot} out of range 0..{self.n_tenants - 1}")


@dataclass(frozen=True, slots=True)
class SlotLimits:
    """This proxy's share of one tenant's limits (None: unlimited).

    Attributes
    ----------
    requests_per_min, tokens_per_min : float, optional
        Per-minute shares.
    max_concurrent : int, optional
        In-flight share.
    """

    requests_per_min: float | None = None
    tokens_per_min: float | None = None
    max_concurrent: int | None = None

    def __post_init__(self) -> None:
        for name in ("requests_per_min", "tokens_per_min", "max_concurrent"):
            value = getattr(self, name)
            if value is not None and (not math.isfinite(value) or value < 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
