"""A spec's ``[family]``: the simulator's workload families, as sessions for the load driver.

The sessions are :func:`fastroute.workload.family_gen.family_sessions`' own (the same
requests as a simulator run of the same family and seed), sent open loop at
``load × Σ capacity_rps`` when ``load`` is set, else at the family's ``rate_rps``. Each
family's shared text (tree blocks, documents, system prompts) is byte-identical across
requests, so the emulated engines' prefix caches see exactly the sharing the family
describes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from fastroute.fleetbench.spec import BenchSpec
    from fastroute.workload import Session

__all__ = ["family_rate_rps", "family_sessions_for", "describe_family", "saturation_capacity"]

#: Requests sampled from the family to estimate an engine's saturation capacity.
_CAPACITY_SHAPES = 384


def family_rate_rps(spec: BenchSpec) -> float:
    """Mean offered rate, req/s: ``load × capacity`` with ``load``, else ``rate_rps``."""
    if spec.family is None:
        raise ValueError("the spec has no [family]")
    if spec.load is not None:
        return spec.load * spec.fleet.capacity_rps(spec.family.model)
    return spec.family.rate_rps


def describe_family(spec: BenchSpec) -> str:
    """``rag (bursts 3× for 10 s of every 60 s)``: the family in a few words."""
    if spec.family is None:
        raise ValueError("the spec has no [family]")
    fam = spec.family
    kind = type(fam).__struct_config__.tag
    if fam.burst_s > 0:
        every = fam.burst_every_s
        return f"{kind} (bursts {fam.burst_factor:g}× for {fam.burst_s:g} s of every {every:g} s)"
    return str(kind)


def family_sessions_for(spec: BenchSpec) -> list[Session]:
    """The sessions sent during ``warmup_s + duration_s``, sorted by start time.

    Raises
    ------
    fastroute.workload.WorkloadError
        An unreadable trace (``prefix-tree`` with ``trace``).
    """
    from fastroute.workload.family_gen import family_sessions

    assert spec.family is not None
    family = msgspec.structs.replace(spec.family, rate_rps=family_rate_rps(spec))
    return family_sessions(
        family,
        duration_s=spec.warmup_s + spec.duration_s,
        sources=tuple(r.name for r in spec.fleet.regions),
        seed=spec.seed,
        base_dir=spec.base_dir,
    )


def saturation_capacity(spec: BenchSpec, profile: str) -> float:
    """One engine's saturation capacity on the family's requests, req/s, without prefix reuse.

    The simulator's estimate (:func:`fastroute.emulator.saturation.saturation_capacity_rps`,
    the unit of its ``target_load``) on request shapes sampled from the family at its own
    ``rate_rps``.
    """
    from fastroute.emulator.model import EngineConfig
    from fastroute.emulator.saturation import saturation_capacity_rps
    from fastroute.hardware import get_profile
    from fastroute.workload.family_gen import family_sessions
    from fastroute.workload.shapes import request_shapes

    assert spec.family is not None
    # The family at its own rate_rps: the sample must not depend on the capacity it gives.
    sample = family_sessions(
        spec.family,
        duration_s=spec.warmup_s + spec.duration_s,
        sources=tuple(r.name for r in spec.fleet.regions),
        seed=spec.seed,
        base_dir=spec.base_dir,
    )
    shapes = request_shapes(sample, _CAPACITY_SHAPES, seed=spec.seed)
    return saturation_capacity_rps(get_profile(profile), EngineConfig(), shapes)
