"""Engine saturation capacity (req/s at ρ = 1) and idle latencies, from the performance model.

Capacity is *measured*, not guessed: :func:`saturation_capacity_rps` replays a batch of
the workload's own request shapes, all arriving at once, through a fresh
:class:`~fastroute.emulator.model.EngineModel` and takes the completion rate up to
the 90th-percentile completion (the drain tail, when the batch empties, is excluded).
Prompts get unique block hashes, so the figure is the capacity *without* prefix-cache
reuse: routing that keeps sessions on their engine gains headroom above it. (The fleet
benchmark's SLO capacity with reuse, :func:`fastroute.fleetbench.capacity.slo_capacity_rps`,
runs the same replay loop.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from fastroute.emulator.model import EngineConfig, EngineModel, Request, replay
from fastroute.hardware import HardwareProfile
from fastroute.workload.shapes import request_shapes

__all__ = ["request_shapes", "saturation_capacity_rps", "idle_latencies"]


def saturation_capacity_rps(
    profile: HardwareProfile,
    config: EngineConfig,
    shapes: Sequence[tuple[int, int]],
) -> float:
    """Saturated completion rate of one engine on ``shapes`` (req/s).

    Raises
    ------
    ValueError
        No shapes, or none of them fits the engine.
    """
    model = EngineModel(profile, replace(config, max_waiting=max(config.max_waiting, len(shapes))))
    arrivals = []
    for i, (prompt, out) in enumerate(shapes):
        prompt = min(prompt, model.max_model_len - out - 1)
        if prompt < 1:
            continue
        # Unique (fake) block hashes: no prefix-cache reuse between requests.
        hashes = [hash((i, b)) & (2**63 - 1) for b in range(prompt // 16)]
        arrivals.append((0.0, Request(f"cal-{i}", prompt, hashes, output_tokens=out)))
    if not arrivals:
        raise ValueError("no request shape fits the engine")
    done = replay(model, arrivals)
    finish = sorted(r.finish_s for r in done if r.finish_s is not None)
    k = max(1, int(0.9 * len(finish)))
    return k / max(finish[k - 1], 1e-9)


def idle_latencies(
    profile: HardwareProfile, mean_prompt_tokens: float, mean_context_tokens: float
) -> tuple[float, float]:
    """(TTFT, TBOT) in seconds of a typical request alone on an idle engine."""
    return (
        profile.prefill_time_s(max(1, round(mean_prompt_tokens))),
        profile.decode_time_s(1, max(1, round(mean_context_tokens))),
    )
