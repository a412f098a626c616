"""The emulator's *true* step times: a datasheet profile scaled by per-coefficient factors.

The datasheet profiles themselves live in :mod:`fastroute.hardware`; a real engine
deviates from them, and the emulator and the simulator model that deviation here while
the router keeps starting from the datasheet's figures.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

from fastroute.hardware import HardwareProfile

__all__ = ["STEP_TIME_COEFFICIENTS", "true_profile"]

#: Coefficients a ``step_time_factors`` table may scale (:func:`true_profile`).
STEP_TIME_COEFFICIENTS = ("a0_s", "a1_s", "a2_s", "a3_s", "b0_s", "b1_s", "b2_s")


def true_profile(profile: HardwareProfile, factors: Mapping[str, float]) -> HardwareProfile:
    """``profile`` with its step-time coefficients multiplied by ``factors`` (same name).

    A derived profile is a datasheet estimate; real engines deviate from it. The
    simulator and the emulator run an engine group's *true* step times this way while
    the router starts from the datasheet's (the profile of the same name).

    Raises
    ------
    ValueError
        A factor names no coefficient or is not > 0.
    """
    if not factors:
        return profile
    changes = {}
    for key, f in factors.items():
        if key not in STEP_TIME_COEFFICIENTS:
            raise ValueError(
                f"unknown step-time coefficient {key!r}; choose from {STEP_TIME_COEFFICIENTS}"
            )
        if not (f > 0 and math.isfinite(f)):
            raise ValueError(f"step-time factor {key} must be a finite number > 0, got {f}")
        changes[key] = getattr(profile, key) * f
    return replace(profile, **changes)
