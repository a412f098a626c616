"""One engine's saturation capacity (req/s at ρ = 1) on a batch of request shapes.

Measured, not guessed: the shapes all arrive at once at a fresh
:class:`~fastroute.emulator.model.EngineModel`, and the capacity is the completion rate up
to the 90th-percentile completion (the drain tail, when the batch empties, is excluded).
Prompts get unique block hashes, so the figure is the capacity *without* prefix-cache
reuse. The simulator's ``target_load`` and the fleet benchmark's family rates are both in
this unit, which is why it lives with the model both of them run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from fastroute.emulator.model import EngineConfig, EngineModel, Request, replay
from fastroute.hardware import HardwareProfile

__all__ = ["SATURATION_QUANTILE", "saturation_capacity_rps"]

#: Completions counted: up to this quantile (the batch's drain tail is not capacity).
SATURATION_QUANTILE = 0.9


def saturation_capacity_rps(
    profile: HardwareProfile,
    config: EngineConfig,
    shapes: Sequence[tuple[int, int]],
) -> float:
    """Saturated completion rate of one engine on ``shapes`` ((prompt, output) tokens), req/s.

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
    finish = sorted(r.finish_s for r in replay(model, arrivals) if r.finish_s is not None)
    k = max(1, int(SATURATION_QUANTILE * len(finish)))
    return k / max(finish[k - 1], 1e-9)
