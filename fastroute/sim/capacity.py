"""Engine saturation capacity (req/s at ρ = 1) and idle latencies, from the performance model.

Capacity is *measured*, not guessed: :func:`saturation_capacity_rps`
(:mod:`fastroute.emulator.saturation`, shared with the fleet benchmark) replays a batch of
the workload's own request shapes through a fresh engine model. It is the capacity
*without* prefix-cache reuse: routing that keeps sessions on their engine gains headroom
above it. (The fleet
benchmark's SLO capacity with reuse, :func:`fastroute.fleetbench.capacity.slo_capacity_rps`,
runs the same replay loop.)
"""

from __future__ import annotations

from fastroute.emulator.saturation import saturation_capacity_rps
from fastroute.hardware import HardwareProfile
from fastroute.workload.shapes import request_shapes

__all__ = ["request_shapes", "saturation_capacity_rps", "idle_latencies"]


def idle_latencies(
    profile: HardwareProfile, mean_prompt_tokens: float, mean_context_tokens: float
) -> tuple[float, float]:
    """(TTFT, TBOT) in seconds of a typical request alone on an idle engine."""
    return (
        profile.prefill_time_s(max(1, round(mean_prompt_tokens))),
        profile.decode_time_s(1, max(1, round(mean_context_tokens))),
    )
