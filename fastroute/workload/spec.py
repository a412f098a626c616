"""The chat workload description: frozen msgspec Structs, every field defaulted.

Decode one from a TOML table with :meth:`ChatWorkload.from_dict` (``msgspec.convert``
plus the cross-field checks), so a scenario file can say only what differs from the
defaults. Defaults follow docs/algorithms.md §7.2 (ShareGPT-like lengths).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from fastroute.errors import FastrouteError

__all__ = [
    "WorkloadError",
    "LogNormal",
    "TenantMix",
    "Weighted",
    "Diurnal",
    "Burst",
    "ChatWorkload",
]

_OPTS: dict[str, Any] = {"frozen": True, "kw_only": True, "forbid_unknown_fields": True}


class WorkloadError(FastrouteError, ValueError):
    """A workload description or trace file that cannot be used (the message says why)."""


class LogNormal(msgspec.Struct, **_OPTS):
    """A lognormal token count, rounded and clipped: ``clip(round(median·e^{σZ}), min, max)``.

    Attributes
    ----------
    median : float
        Median in tokens (``e^μ``), > 0.
    sigma : float
        Log-space standard deviation σ, ≥ 0 (0 = always the median).
    min : int
        Smallest value returned, ≥ 1.
    max : int
        Largest value returned, ≥ ``min``.
    """

    median: float = 200.0
    sigma: float = 0.9
    min: int = 1
    max: int = 2048

    def sample(self, gauss: float) -> int:
        """Map one standard-normal draw to a token count."""
        value = round(self.median * math.exp(self.sigma * gauss))
        return self.max if value > self.max else (self.min if value < self.min else value)


class TenantMix(msgspec.Struct, **_OPTS):
    """One tenant: its share of sessions and its shared system prompt.

    Attributes
    ----------
    name : str
        Tenant name (also seeds the system prompt text, so equal names share it).
    weight : float
        Relative share of sessions, > 0.
    system_prompt_tokens : int
        Length of the system prompt every session of the tenant starts with (0 = none).
    """

    name: str = "default"
    weight: float = 1.0
    system_prompt_tokens: int = 256


class Weighted(msgspec.Struct, **_OPTS):
    """A name with a relative weight (models, source regions).

    Attributes
    ----------
    name : str
        Model or source-region name.
    weight : float
        Relative share of sessions, > 0.
    """

    name: str
    weight: float = 1.0


class Diurnal(msgspec.Struct, **_OPTS):
    """A sinusoidal demand cycle per source: ``λ_s(t) = λ̄_s·(1 + A·sin(2π(t − φ_s)/P))``.

    Attributes
    ----------
    period_s : float
        Cycle length P in seconds (86 400 = a day; shorter in simulations).
    amplitude : float
        Relative amplitude A in ``[0, 1)``.
    phase_s : dict of str to float
        Phase φ_s per source name, in seconds; sources not named have phase 0.
    """

    period_s: float = 86_400.0
    amplitude: float = 0.5
    phase_s: dict[str, float] = {}


class Burst(msgspec.Struct, **_OPTS):
    """A demand spike: the session rate is multiplied during a window.

    Attributes
    ----------
    start_s : float
        Start of the window, seconds from the start of the run.
    duration_s : float
        Length of the window, > 0.
    rate_multiplier : float
        Factor on the session rate inside the window, > 0.
    sources : tuple of str
        Sources affected; empty = all.
    """

    start_s: float
    duration_s: float
    rate_multiplier: float = 3.0
    sources: tuple[str, ...] = ()


class ChatWorkload(msgspec.Struct, **_OPTS):
    """Multi-turn chat sessions (docs/algorithms.md §7.2).

    Sessions arrive per source at ``rate_sessions_per_s × source weight`` (shaped by
    :attr:`diurnal` and :attr:`bursts`). A session has a geometric number of turns; each
    turn sends the whole previous context plus new user text; the next turn starts an
    exponential think time after the reply.

    Attributes
    ----------
    rate_sessions_per_s : float
        Mean session arrival rate over all sources, > 0.
    arrival : {"poisson", "gamma"}
        Session inter-arrival law (gamma: a renewal process with CV :attr:`arrival_cv`).
    arrival_cv : float
        Coefficient of variation of inter-arrival times for ``"gamma"`` (> 0; 1 = Poisson).
    mean_turns : float
        Mean of the geometric number of turns per session, ≥ 1.
    think_time_s : float
        Mean of the exponential pause between a reply and the next turn, ≥ 0.
    prompt_tokens : LogNormal
        New user tokens per turn.
    output_tokens : LogNormal
        ``max_tokens`` per turn (ShareGPT-like: median 200).
    max_context_tokens : int
        A session ends before a turn's prompt + max_tokens would exceed this.
    tenants : tuple of TenantMix
        Tenants with their shared system prompts.
    models : tuple of Weighted
        Model names with weights.
    sources : tuple of Weighted
        Source clusters (regions) with weights.
    diurnal : Diurnal or None
        Per-source daily cycle; None = constant rate.
    bursts : tuple of Burst
        Demand spikes.
    """

    rate_sessions_per_s: float = 1.0
    arrival: Literal["poisson", "gamma"] = "poisson"
    arrival_cv: float = 1.0
    mean_turns: float = 4.0
    think_time_s: float = 5.0
    prompt_tokens: LogNormal = LogNormal(median=150.0, sigma=0.8, min=4, max=2048)
    output_tokens: LogNormal = LogNormal(median=200.0, sigma=0.9, min=1, max=1024)
    max_context_tokens: int = 8192
    tenants: tuple[TenantMix, ...] = (TenantMix(),)
    models: tuple[Weighted, ...] = (Weighted(name="demo-8b"),)
    sources: tuple[Weighted, ...] = (Weighted(name="local"),)
    diurnal: Diurnal | None = None
    bursts: tuple[Burst, ...] = ()

    def __post_init__(self) -> None:
        _check(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ChatWorkload:
        """Decode a workload from a TOML/JSON table.

        Raises
        ------
        WorkloadError
            Wrong types, unknown keys or inconsistent values; the message names the path.
        """
        try:
            return msgspec.convert(dict(data), cls)
        except msgspec.ValidationError as exc:
            raise WorkloadError(f"invalid workload: {exc}") from None

    def rate_multiplier(self, source: str, t_s: float) -> float:
        """Rate factor of ``source`` at time ``t_s`` (diurnal × bursts)."""
        factor = 1.0
        d = self.diurnal
        if d is not None:
            phase = d.phase_s.get(source, 0.0)
            factor = 1.0 + d.amplitude * math.sin(2.0 * math.pi * (t_s - phase) / d.period_s)
        for b in self.bursts:
            if b.start_s <= t_s < b.start_s + b.duration_s and (
                not b.sources or source in b.sources
            ):
                factor *= b.rate_multiplier
        return factor


def _check(w: ChatWorkload) -> None:
    # msgspec.ValidationError from __post_init__ gets the JSON path attached by convert().
    def bad(msg: str) -> None:
        raise msgspec.ValidationError(msg)

    if not w.rate_sessions_per_s > 0:
        bad("rate_sessions_per_s must be > 0")
    if not w.arrival_cv > 0:
        bad("arrival_cv must be > 0")
    if not w.mean_turns >= 1:
        bad("mean_turns must be >= 1")
    if not w.think_time_s >= 0:
        bad("think_time_s must be >= 0")
    for name, ln in (("prompt_tokens", w.prompt_tokens), ("output_tokens", w.output_tokens)):
        if not (ln.median > 0 and ln.sigma >= 0 and 1 <= ln.min <= ln.max):
            bad(f"{name} needs median > 0, sigma >= 0 and 1 <= min <= max")
    for field, items in (("tenants", w.tenants), ("models", w.models), ("sources", w.sources)):
        if not items:
            bad(f"{field} must not be empty")
        names = [i.name for i in items]
        if len(set(names)) != len(names):
            bad(f"{field} names must be unique, got {names}")
        if any(not i.weight > 0 for i in items):
            bad(f"{field} weights must be > 0")
    if any(t.system_prompt_tokens < 0 for t in w.tenants):
        bad("system_prompt_tokens must be >= 0")
    longest_system = max(t.system_prompt_tokens for t in w.tenants)
    # The first turn must fit with its smallest user text and smallest output.
    if longest_system + w.prompt_tokens.min + w.output_tokens.min + 64 > w.max_context_tokens:
        bad(
            f"max_context_tokens={w.max_context_tokens} cannot hold the longest system prompt "
            f"({longest_system}) plus the smallest turn"
        )
    d = w.diurnal
    if d is not None and not (d.period_s > 0 and 0 <= d.amplitude < 1):
        bad("diurnal needs period_s > 0 and 0 <= amplitude < 1")
    for b in w.bursts:
        if not (b.duration_s > 0 and b.rate_multiplier > 0 and b.start_s >= 0):
            bad("bursts need start_s >= 0, duration_s > 0 and rate_multiplier > 0")
