"""Hardware profiles of simulated engines: datasheet (nominal) vs true step times.

The profiles themselves are the emulator's (:data:`fastroute.emulator.profiles.PROFILES`:
every GPU with Llama-3-8B, ``"a40"``, and with Qwen2.5-3B, ``"a40-qwen2.5-3b"``), so the
simulator, the emulator and the proxy's calibration read the same datasheet figures.

**True vs nominal constants.** A derived profile is a datasheet estimate: what an
operator knows before measuring anything, and what the marginal-cost policy starts from
(:func:`nominal_step_times`). Real engines deviate from it. An engine group's
``step_time_factors`` multiplies the profile's coefficients to give the engine's *true*
step times (:func:`~fastroute.emulator.profiles.true_profile`); the policy is not told
them and has to calibrate.
"""

from __future__ import annotations

from fastroute.emulator.profiles import HardwareProfile, get_profile, true_profile
from fastroute.predict.step_time import NominalStepTimes

__all__ = ["sim_profile", "true_profile", "nominal_step_times"]

#: The profile of a name (the emulator's; ``KeyError`` lists the choices).
sim_profile = get_profile


def nominal_step_times(profile: HardwareProfile, budget: int | None = None) -> NominalStepTimes:
    """The datasheet constants of ``profile`` as the policy's starting point."""
    return NominalStepTimes.from_profile(
        profile, max_num_batched_tokens=budget or profile.default_max_num_batched_tokens
    )
