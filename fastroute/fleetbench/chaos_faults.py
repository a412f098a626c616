"""The chaos run's faults: a seeded schedule, and how each fault is injected and cleared.

One fault at a time, so at least ``n_engines - 1`` engines can serve throughout: a request
that fails while one fault is active failed where another engine could have served it.
Each fault kind's duration is long enough to outlast the proxy's detection of it (ejection
after consecutive failures, the attempt timeouts, the controller's staleness after three
scrape intervals) and short enough that a 10-minute run sees every kind at least twice.

===================  ===========================================================================
kind                 injected as
===================  ===========================================================================
``engine_sigkill``   SIGKILL of one engine's process while streams are running; restarted on
                     the same port when the fault ends
``engine_hang``      the engine accepts requests and never answers (emulator ``hang``)
``engine_slow``      every step 3× slower (``slowdown = 3``)
``error_burst``      every new request answered 500 at once (``error_rate = 1``)
``stream_errors``    streams break off with vLLM's in-stream error event after 5 tokens
``refuse``           the engine's listener closed: connections refused; it reopens by itself
                     after the fault's duration (no request can reach it to clear it)
``drain``            ``/health`` 503, new requests 503, requests in flight finish
``metrics_timeout``  ``GET /metrics`` answers after 5 s (past every scrape timeout)
``metrics_lie``      ``GET /metrics`` claims the engine is idle (no running or waiting
                     requests, empty KV cache) while it serves
``controller_kill``  SIGKILL of the controller; restarted when the fault ends
``worker_kill``      SIGKILL of one proxy worker (the supervisor restarts it)
``broken_reload``    the proxy's config file replaced by invalid TOML, then SIGHUP; restored
===================  ===========================================================================
"""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DURATION_S",
    "ENGINE_FAULTS",
    "FAULT_KINDS",
    "FaultEvent",
    "engine_fault_body",
    "schedule",
    "worker_pids",
]

#: Faults set through the emulator's ``/admin/fault`` and the body that sets them.
ENGINE_FAULTS: dict[str, dict[str, object]] = {
    "engine_hang": {"hang": True},
    "engine_slow": {"slowdown": 3.0},
    "error_burst": {"error_rate": 1.0, "error_status": 500},
    "stream_errors": {"stream_error_after_tokens": 5},
    "refuse": {"refuse_connections": True, "refuse_for_s": 12.0},  # reopens by itself
    "drain": {"drain": True},
    "metrics_timeout": {"metrics_delay_s": 5.0},
    "metrics_lie": {"metrics_lie": True},
}
#: Every fault kind, in the order of the module's table.
FAULT_KINDS: tuple[str, ...] = (
    "engine_sigkill", *ENGINE_FAULTS, "controller_kill", "worker_kill", "broken_reload",
)  # fmt: skip
#: How long each kind stays on, seconds (see the module docstring for why these lengths).
DURATION_S: dict[str, float] = {
    "engine_sigkill": 15.0,
    "engine_hang": 15.0,
    "engine_slow": 30.0,
    "error_burst": 8.0,
    "stream_errors": 15.0,
    "refuse": 12.0,
    "drain": 20.0,
    "metrics_timeout": 20.0,
    "metrics_lie": 20.0,
    "controller_kill": 12.0,
    "worker_kill": 1.0,
    "broken_reload": 5.0,
}
#: Kinds whose target is one engine (the rest target the controller or the proxy).
ENGINE_TARGETED = frozenset({"engine_sigkill", *ENGINE_FAULTS})


@dataclass(frozen=True)
class FaultEvent:
    """One fault of the schedule.

    Attributes
    ----------
    kind : str
        One of :data:`FAULT_KINDS`.
    target : int
        The engine's index for engine faults, else 0.
    start_s, end_s : float
        When it is injected and cleared, seconds after the run's start.
    """

    kind: str
    target: int
    start_s: float
    end_s: float


def schedule(
    seed: int,
    duration_s: float,
    n_engines: int,
    *,
    warmup_s: float = 20.0,
    gap_s: float = 10.0,
    kinds: Sequence[str] = FAULT_KINDS,
) -> list[FaultEvent]:
    """A seeded schedule: the kinds in shuffled rounds (every kind once per round), one at a
    time with ``gap_s`` of calm between them, from ``warmup_s`` until ``duration_s``.

    Raises
    ------
    ValueError
        An unknown kind, or fewer than two engines (one fault would leave none to serve).
    """
    unknown = sorted(set(kinds) - set(FAULT_KINDS))
    if unknown:
        raise ValueError(f"unknown fault kinds {unknown}; known: {list(FAULT_KINDS)}")
    if n_engines < 2:
        raise ValueError(f"a chaos run needs at least 2 engines, got {n_engines}")
    rng = random.Random(seed)
    events: list[FaultEvent] = []
    t = warmup_s
    while True:
        order = list(kinds)
        rng.shuffle(order)
        for kind in order:
            end = t + DURATION_S[kind]
            if end + gap_s > duration_s:
                return events
            target = rng.randrange(n_engines) if kind in ENGINE_TARGETED else 0
            events.append(FaultEvent(kind, target, t, end))
            t = end + gap_s


def engine_fault_body(kind: str) -> dict[str, object]:
    """The ``POST /admin/fault`` body that sets an engine fault kind."""
    return dict(ENGINE_FAULTS[kind])


def worker_pids(supervisor_pid: int) -> list[int]:
    """The proxy supervisor's children (its workers), from ``/proc``."""
    path = Path(f"/proc/{supervisor_pid}/task/{supervisor_pid}/children")
    try:
        return [int(p) for p in path.read_text().split()]
    except OSError:
        return []


def kill_one_worker(supervisor_pid: int, rng: random.Random) -> int | None:
    """SIGKILL one of the supervisor's workers, chosen by ``rng``; its pid, or None."""
    pids = worker_pids(supervisor_pid)
    if not pids:
        return None
    pid = rng.choice(pids)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return None
    return pid
