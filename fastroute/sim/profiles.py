"""Hardware profiles of simulated engines, and their deviation from the datasheet.

The emulator's built-in profiles (:data:`fastroute.emulator.profiles.PROFILES`) all serve
Llama-3-8B. The P/D experiment (h) reproduces the setup of "Calibrate, Then Route"
(Qwen2.5-3B on A40s, reference/algorithms.md §6.1), so this module adds profiles derived
the same way (:func:`~fastroute.emulator.profiles.derive_profile`) for other models:

``a40-qwen2.5-3b``
    Qwen2.5-3B (config.json: 36 layers, 2 KV heads, head dim 128, hidden 2048, 3.09 B
    parameters), bf16, on an A40.

**True vs nominal constants.** A derived profile is a datasheet estimate: what an
operator knows before measuring anything, and what the marginal-cost policy starts from
(:func:`nominal_step_times`). Real engines deviate from it. An engine group's
``step_time_factors`` multiplies the profile's coefficients to give the engine's *true*
step times (:func:`true_profile`); the policy is not told them and has to calibrate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from fastroute.emulator.profiles import GPUS, PROFILES, HardwareProfile, ModelSpec, derive_profile
from fastroute.predict.step_time import NominalStepTimes

__all__ = [
    "QWEN_2_5_3B",
    "SIM_PROFILES",
    "STEP_TIME_COEFFICIENTS",
    "sim_profile",
    "true_profile",
    "nominal_step_times",
]

#: Qwen2.5-3B (Hugging Face config.json), bf16.
QWEN_2_5_3B = ModelSpec(
    name="qwen2.5-3b",
    num_params=3_085_938_688,
    num_layers=36,
    num_kv_heads=2,
    head_dim=128,
    hidden_size=2048,
    dtype_bytes=2,
    max_model_len=32768,
)

#: Profiles beyond the emulator's, by name.
SIM_PROFILES: dict[str, HardwareProfile] = {
    "a40-qwen2.5-3b": dataclasses.replace(
        derive_profile(GPUS["a40"], QWEN_2_5_3B), name="a40-qwen2.5-3b"
    ),
}

#: Coefficients ``step_time_factors`` may scale.
STEP_TIME_COEFFICIENTS = ("a0_s", "a1_s", "a2_s", "a3_s", "b0_s", "b1_s", "b2_s")


def sim_profile(name: str) -> HardwareProfile:
    """The profile ``name``: one of :data:`SIM_PROFILES` or the emulator's built-ins.

    Raises
    ------
    KeyError
        Unknown name (the message lists the choices).
    """
    key = name.lower()
    profile = SIM_PROFILES.get(key) or PROFILES.get(key)
    if profile is None:
        choices = sorted({*SIM_PROFILES, *PROFILES})
        raise KeyError(f"unknown profile {name!r}; choose one of {choices}")
    return profile


def true_profile(profile: HardwareProfile, factors: Mapping[str, float]) -> HardwareProfile:
    """``profile`` with its step-time coefficients multiplied by ``factors`` (same name).

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
        if not f > 0:
            raise ValueError(f"step-time factor {key} must be > 0, got {f}")
        changes[key] = getattr(profile, key) * f
    return dataclasses.replace(profile, **changes)


def nominal_step_times(profile: HardwareProfile, budget: int | None = None) -> NominalStepTimes:
    """The datasheet constants of ``profile`` as the policy's starting point."""
    return NominalStepTimes.from_profile(
        profile, max_num_batched_tokens=budget or profile.default_max_num_batched_tokens
    )
