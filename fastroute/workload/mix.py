"""Bursty mixed trace replay: several traces interleaved at a chosen rate, with bursts.

A scenario's ``[replay]`` section (:class:`ReplayMix`) builds the workload of experiment
(h) from real traces (``../shared/traces``: Azure LLM inference conv and code, Mooncake):

1. **Window.** For each component trace, a contiguous run of records starting at a
   seed-dependent offset (uniform in ``[0, max_offset)`` records), as many as the
   component needs; its own inter-arrival pattern (the trace's burstiness) is kept.
2. **Rate.** The window's times are scaled uniformly so the component's mean rate is
   ``share · rate_rps``; components are interleaved by time.
3. **Bursts.** Time is warped so that the arrival intensity is ``burst_factor`` times
   the mean for ``burst_s`` out of every ``burst_every_s`` seconds (burst phase drawn
   from the seed) and correspondingly lower in between; the mean rate is unchanged.
   Requires ``burst_factor · burst_s < burst_every_s``.

Every request is a single-turn session (the Azure traces carry no sessions) named
``{component}-{record}``, so two seeds replay different windows with different phases.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import msgspec

from fastroute.workload.session import Session
from fastroute.workload.spec import WorkloadError
from fastroute.workload.trace import load_trace

__all__ = ["ReplayComponent", "ReplayMix", "mixed_replay_sessions", "burst_warp"]

_OPTS = {"frozen": True, "kw_only": True, "forbid_unknown_fields": True}


class ReplayComponent(msgspec.Struct, **_OPTS):  # type: ignore[call-arg]
    """One trace of the mix.

    Attributes
    ----------
    name : str
        Label (session id prefix).
    path : str
        CSV/JSONL trace (:func:`fastroute.workload.load_trace` formats), relative to the
        scenario file.
    share : float
        Fraction of the mix's requests, > 0 (shares are normalised).
    max_offset : int
        Seed-dependent start offset, records, drawn in ``[0, max_offset)``.
    max_prompt_tokens : int or None
        Drop records with longer prompts (None: keep all).
    """

    name: str
    path: str
    share: float = 1.0
    max_offset: int = 2000
    max_prompt_tokens: int | None = None


class ReplayMix(msgspec.Struct, **_OPTS):  # type: ignore[call-arg]
    """A bursty mix of traces (see the module docstring).

    Attributes
    ----------
    components : tuple of ReplayComponent
    rate_rps : float
        Mean offered requests per second, > 0.
    burst_every_s, burst_s : float
        Burst period and length, seconds (``burst_s = 0``: no bursts).
    burst_factor : float
        Intensity during a burst relative to the mean, >= 1.
    model : str
        Model of every request.
    """

    components: tuple[ReplayComponent, ...]
    rate_rps: float
    burst_every_s: float = 60.0
    burst_s: float = 0.0
    burst_factor: float = 1.0
    model: str = "demo-8b"

    def check(self) -> None:
        """Raise :class:`WorkloadError` on inconsistent parameters."""
        if not self.components:
            raise WorkloadError("replay needs at least one component")
        if not self.rate_rps > 0:
            raise WorkloadError(f"replay.rate_rps must be > 0, got {self.rate_rps}")
        for c in self.components:
            if not c.share > 0 or c.max_offset < 0:
                raise WorkloadError(f"replay component {c.name!r}: need share > 0, max_offset >= 0")
        if self.burst_s > 0:
            if not (self.burst_every_s > 0 and self.burst_factor >= 1):
                raise WorkloadError("replay bursts need burst_every_s > 0 and burst_factor >= 1")
            if self.burst_factor * self.burst_s >= self.burst_every_s:
                raise WorkloadError(
                    "replay bursts need burst_factor * burst_s < burst_every_s "
                    f"(got {self.burst_factor} * {self.burst_s} >= {self.burst_every_s})"
                )


_cache: dict[tuple[str, str], list[Session]] = {}


def _load(path: Path, model: str) -> list[Session]:
    """A whole trace (cached per process: a sweep replays the same files many times)."""
    key = (str(path), model)
    rows = _cache.get(key)
    if rows is None:
        if len(_cache) >= 8:
            _cache.clear()
        rows = _cache[key] = load_trace(path, model=model)
    return rows


def burst_warp(u: float, every_s: float, burst_s: float, factor: float, phase_s: float) -> float:
    """Real time of "mean-rate time" ``u`` under the burst intensity profile.

    Intensity is ``factor`` inside ``[k·every + phase, k·every + phase + burst)`` and
    ``low = (every − factor·burst) / (every − burst)`` elsewhere, so one period of real
    time holds exactly one period of mean-rate time; the map is increasing.
    """
    if burst_s <= 0 or factor == 1.0:
        return u
    low = (every_s - factor * burst_s) / (every_s - burst_s)
    x = u + phase_s  # shift so that bursts start at multiples of every_s
    k = math.floor(x / every_s)
    r = x - k * every_s
    in_burst = factor * burst_s  # mean-rate time covered by the burst part of a period
    if r < in_burst:
        t = r / factor
    else:
        t = burst_s + (r - in_burst) / low
    return k * every_s + t - phase_s


def mixed_replay_sessions(
    mix: ReplayMix,
    *,
    duration_s: float,
    sources: tuple[str, ...],
    seed: int,
    base_dir: str = "",
) -> list[Session]:
    """The sessions of ``mix`` starting in ``[0, duration_s)``, sorted by start time.

    Raises
    ------
    WorkloadError
        Bad parameters, a missing or malformed trace, or a trace too short for the window.
    """
    mix.check()
    rng = random.Random(f"replay/{seed}")
    total_share = sum(c.share for c in mix.components)
    out: list[Session] = []
    for comp in mix.components:
        rate = mix.rate_rps * comp.share / total_share
        need = int(math.ceil(rate * duration_s * 1.1)) + 10
        offset = rng.randrange(comp.max_offset) if comp.max_offset else 0
        path = Path(comp.path)
        if not path.is_absolute() and base_dir:
            path = Path(base_dir) / path
        rows = _load(path, mix.model)
        if comp.max_prompt_tokens is not None:
            cap = comp.max_prompt_tokens
            rows = [s for s in rows if s.prompt_tokens_hint and s.prompt_tokens_hint[0] <= cap]
        window = rows[offset : offset + need]
        if len(window) < 2:
            raise WorkloadError(f"replay component {comp.name!r}: trace {path} too short")
        t0 = window[0].start_s
        span = window[-1].start_s - t0
        scale = (len(window) - 1) / rate / span if span > 0 else 1.0
        for i, s in enumerate(window):
            start = (s.start_s - t0) * scale
            if start >= duration_s:
                break
            out.append(
                msgspec.structs.replace(
                    s,
                    session_id=f"{comp.name}-{offset + i:06d}",
                    tenant=comp.name,
                    source=sources[(offset + i) % len(sources)],
                    start_s=start,
                )
            )
    phase = rng.uniform(0.0, mix.burst_every_s) if mix.burst_s > 0 else 0.0
    shape = (mix.burst_every_s, mix.burst_s, mix.burst_factor, phase)
    origin = burst_warp(0.0, *shape)
    warped = []
    for s in out:
        t = burst_warp(s.start_s, *shape) - origin
        if t < duration_s:
            warped.append(msgspec.structs.replace(s, start_s=t))
    warped.sort(key=lambda s: (s.start_s, s.session_id))
    return warped
