"""Each engine's share of the controller's LP allocation over a measured window.

The benchmark compares what an engine served with what the LP planned for it (the
hot-prefix criterion: the hottest engine's load ≤ 1.3× its LP share). The plan moves
from period to period, so the share is the mean of samples of ``GET /v1/plan`` taken
every ``period_s`` over the window: per sample, an engine's Σ ``allocation_rps`` over
the classes divided by the fleet's Σ. A sample that cannot be fetched or holds no plan
yet is skipped, never an exception.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from fastroute.fleetbench.scrape import fetch_json

__all__ = ["plan_shares", "mean_shares", "LpShareSampler", "load_over_share"]


def plan_shares(plan: object) -> dict[str, float] | None:
    """Engine → its share of the plan's allocation (``GET /v1/plan`` JSON), or None when
    the plan allocates nothing."""
    if not isinstance(plan, dict):
        return None
    totals: dict[str, float] = {}
    for cls in plan.get("classes") or ():
        for engine, rps in (cls.get("allocation_rps") or {}).items():
            totals[engine] = totals.get(engine, 0.0) + float(rps)
    total = sum(totals.values())
    if total <= 0:
        return None
    return {engine: rps / total for engine, rps in totals.items()}


def mean_shares(samples: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The per-engine mean over ``samples`` (an engine absent from a sample had 0)."""
    if not samples:
        return {}
    engines = sorted({e for s in samples for e in s})
    return {e: sum(s.get(e, 0.0) for s in samples) / len(samples) for e in engines}


def load_over_share(served: Mapping[str, float], planned: Mapping[str, float]) -> float | None:
    """The largest served share / planned share over engines with a planned share, or
    None without one (no controller, or no plan)."""
    ratios = [served.get(e, 0.0) / p for e, p in planned.items() if p > 0]
    return max(ratios) if ratios else None


class LpShareSampler:
    """Samples the controller's plan every ``period_s`` until :meth:`stop`.

    Parameters
    ----------
    controller_url : str
        Base URL of the controller (``http://host:port``).
    period_s : float
        Seconds between samples (the controller's period: one sample per plan).
    """

    def __init__(self, controller_url: str, period_s: float) -> None:
        self.url = controller_url.rstrip("/") + "/v1/plan"
        self.period_s = period_s
        self.samples: list[dict[str, float]] = []
        self._task: asyncio.Task[Any] | None = None

    def start(self) -> None:
        """Begin sampling on the running loop."""
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            shares = plan_shares(await fetch_json(self.url))
            if shares is not None:
                self.samples.append(shares)
            await asyncio.sleep(self.period_s)

    def stop(self) -> dict[str, float]:
        """Stop sampling; the mean share per engine (empty without samples)."""
        if self._task is not None:
            self._task.cancel()
        return mean_shares(self.samples)
