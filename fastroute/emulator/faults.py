"""Fault injection: the ways a real engine fails, settable at start and live.

=====================  ============================================================
field                  effect
=====================  ============================================================
``slowdown``           every step takes ``slowdown`` × its modelled time (> 0; 1 = off)
``error_rate``         this share of new requests is answered at once with
                       ``error_status`` (429, 500 or 503) in vLLM's error shape
``hang``               new requests are accepted and never answered (until the
                       client gives up or the engine stops)
``crash_after_tokens`` each request's connection is closed abruptly once it has
                       been given this many tokens (mid-stream for SSE; before any
                       byte for JSON)
``stream_error_after_tokens``  a streamed response breaks off in-stream after this many
                       tokens as vLLM does when its engine core dies: one
                       ``data: {"error": {…, "code": 500}}`` event, then ``data: [DONE]``
                       (HTTP status 200 already sent); JSON responses get that 500
``refuse_connections`` the listening socket is closed (connect → ECONNREFUSED) and
                       idle keep-alive connections are dropped; reopened after
                       ``refuse_for_s`` seconds, or when cleared
``metrics_delay_s``    ``GET /metrics`` answers after this delay
``metrics_lie``        ``GET /metrics`` claims an idle engine while it serves: no running
                       or waiting requests, an empty KV cache (a stuck or mis-wired
                       exporter); the counters and histograms stay true
``drain``              ``/health`` answers 503 and new requests get 503; requests in
                       flight finish
=====================  ============================================================

Each change is logged (logger ``fastroute.emulator.faults``) and every active
fault shows as ``fastroute_emulator_fault_active{kind="…"} 1`` in ``/metrics``.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import msgspec

__all__ = ["FaultState", "FaultUpdate", "FaultController", "FAULT_KINDS", "ERROR_STATUSES"]

logger = logging.getLogger(__name__)

#: Status codes ``error_status`` may take.
ERROR_STATUSES = (429, 500, 503)
#: The ``kind`` label values of ``fastroute_emulator_fault_active``.
FAULT_KINDS = (
    "slowdown", "error", "hang", "crash", "stream_error", "refuse", "metrics_delay",
    "metrics_lie", "drain",
)  # fmt: skip


class FaultState(msgspec.Struct, kw_only=True):
    """The faults active on one engine (all off by default)."""

    slowdown: float = 1.0
    error_rate: float = 0.0
    error_status: int = 500
    hang: bool = False
    crash_after_tokens: int | None = None
    stream_error_after_tokens: int | None = None
    refuse_connections: bool = False
    refuse_for_s: float | None = None
    metrics_delay_s: float = 0.0
    metrics_lie: bool = False
    drain: bool = False

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field out of range."""
        if not self.slowdown > 0:
            raise ValueError(f"slowdown must be > 0, got {self.slowdown}")
        if not 0.0 <= self.error_rate <= 1.0:
            raise ValueError(f"error_rate must be in [0, 1], got {self.error_rate}")
        if self.error_status not in ERROR_STATUSES:
            raise ValueError(
                f"error_status must be one of {ERROR_STATUSES}, got {self.error_status}"
            )
        if self.crash_after_tokens is not None and self.crash_after_tokens < 0:
            raise ValueError(f"crash_after_tokens must be >= 0, got {self.crash_after_tokens}")
        if self.stream_error_after_tokens is not None and self.stream_error_after_tokens < 0:
            raise ValueError(
                f"stream_error_after_tokens must be >= 0, got {self.stream_error_after_tokens}"
            )
        if self.refuse_for_s is not None and not self.refuse_for_s > 0:
            raise ValueError(f"refuse_for_s must be > 0, got {self.refuse_for_s}")
        if not self.metrics_delay_s >= 0:
            raise ValueError(f"metrics_delay_s must be >= 0, got {self.metrics_delay_s}")

    def active(self) -> dict[str, bool]:
        """Which fault kinds are on, keyed by :data:`FAULT_KINDS`."""
        return {
            "slowdown": self.slowdown != 1.0,
            "error": self.error_rate > 0.0,
            "hang": self.hang,
            "crash": self.crash_after_tokens is not None,
            "stream_error": self.stream_error_after_tokens is not None,
            "refuse": self.refuse_connections,
            "metrics_delay": self.metrics_delay_s > 0.0,
            "metrics_lie": self.metrics_lie,
            "drain": self.drain,
        }


class FaultUpdate(msgspec.Struct, forbid_unknown_fields=True):
    """A partial update (body of ``POST /admin/fault``): only the fields given change."""

    slowdown: float | msgspec.UnsetType = msgspec.UNSET
    error_rate: float | msgspec.UnsetType = msgspec.UNSET
    error_status: int | msgspec.UnsetType = msgspec.UNSET
    hang: bool | msgspec.UnsetType = msgspec.UNSET
    crash_after_tokens: int | None | msgspec.UnsetType = msgspec.UNSET
    stream_error_after_tokens: int | None | msgspec.UnsetType = msgspec.UNSET
    refuse_connections: bool | msgspec.UnsetType = msgspec.UNSET
    refuse_for_s: float | None | msgspec.UnsetType = msgspec.UNSET
    metrics_delay_s: float | msgspec.UnsetType = msgspec.UNSET
    metrics_lie: bool | msgspec.UnsetType = msgspec.UNSET
    drain: bool | msgspec.UnsetType = msgspec.UNSET

    def changes(self) -> dict[str, Any]:
        """The fields set in this update."""
        return {
            f: getattr(self, f)
            for f in self.__struct_fields__
            if getattr(self, f) is not msgspec.UNSET
        }


class FaultController:
    """Holds an engine's :class:`FaultState` and draws the random faults.

    Parameters
    ----------
    engine_name : str
        For log lines.
    initial : FaultState, optional
        Faults active from the start.
    seed : int
        Seeds the draw of ``error_rate`` faults, so a run is reproducible.
    """

    def __init__(self, engine_name: str, initial: FaultState | None = None, seed: int = 0) -> None:
        self.engine_name = engine_name
        self.state = FaultState()
        self._rng = random.Random(seed)
        #: Injected faults by kind ("error", "hang", "crash", "stream_error"), cumulative.
        self.injected_total: dict[str, int] = {"error": 0, "hang": 0, "crash": 0, "stream_error": 0}
        if initial is not None:
            self.apply(msgspec.structs.asdict(initial))

    def apply(self, changes: dict[str, Any]) -> FaultState:
        """Merge ``changes`` into the state, validate, log; return the new state.

        Raises
        ------
        ValueError
            If the result is invalid; the state is then unchanged.
        """
        new = msgspec.structs.replace(self.state, **changes)
        new.validate()
        old_active = self.state.active()
        self.state = new
        for kind, on in new.active().items():
            if on != old_active[kind]:
                logger.warning(
                    "engine %s: fault %s %s (%s)",
                    self.engine_name,
                    kind,
                    "ON" if on else "off",
                    {k: v for k, v in changes.items()},
                )
        return new

    def clear(self) -> FaultState:
        """Turn every fault off."""
        return self.apply(msgspec.structs.asdict(FaultState()))

    def draw_error(self) -> int | None:
        """Return the status to fail a new request with, or None to serve it."""
        rate = self.state.error_rate
        if rate > 0.0 and self._rng.random() < rate:
            self.injected_total["error"] += 1
            return self.state.error_status
        return None
