"""A spec's ``[replay]``: the simulator's bursty trace mix, as sessions for the load driver.

The sessions are :func:`fastroute.workload.mix.mixed_replay_sessions`' own (the same
windows, rate and bursts as a simulator run with the same mix and seed), so the
benchmark and the simulator replay identical requests. Each is one turn whose
rendered chat prompt has the trace's prompt tokens under the emulator's 4-byte rule
and whose ``max_tokens`` is the trace's output tokens; the driver sends
``ignore_eos``, so the engines generate exactly that many.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from fastroute.fleetbench.spec import BenchSpec
    from fastroute.workload import Session

__all__ = ["replay_rate_rps", "replay_sources", "replay_sessions", "describe_mix"]


def replay_rate_rps(spec: BenchSpec) -> float:
    """Mean offered rate, req/s: ``load × capacity`` with ``load``, else ``rate_rps``."""
    if spec.replay is None:
        raise ValueError("the spec has no [replay]")
    if spec.load is not None:
        return spec.load * spec.fleet.capacity_rps(spec.replay.model)
    return spec.replay.rate_rps


def describe_mix(spec: BenchSpec) -> str:
    """``conv 0.8, code 0.2; bursts 2× for 10 s of every 60 s``: the mix in one line."""
    if spec.replay is None:
        raise ValueError("the spec has no [replay]")
    mix = spec.replay
    shares = ", ".join(f"{c.name} {c.share:g}" for c in mix.components)
    return (
        f"{shares}; bursts {mix.burst_factor:g}× for {mix.burst_s:g} s of every "
        f"{mix.burst_every_s:g} s"
    )


def replay_sources(spec: BenchSpec) -> tuple[str, ...]:
    """Source clusters of the replayed requests: every fleet region, round robin."""
    return tuple(r.name for r in spec.fleet.regions)


def replay_sessions(spec: BenchSpec) -> list[Session]:
    """The sessions sent during ``warmup_s + duration_s``, sorted by start time.

    Raises
    ------
    fastroute.workload.WorkloadError
        A trace is missing, malformed or too short for the window.
    """
    from fastroute.workload.mix import mixed_replay_sessions

    assert spec.replay is not None
    mix = msgspec.structs.replace(spec.replay, rate_rps=replay_rate_rps(spec))
    return mixed_replay_sessions(
        mix,
        duration_s=spec.warmup_s + spec.duration_s,
        sources=replay_sources(spec),
        seed=spec.seed,
        base_dir=spec.base_dir,
    )
