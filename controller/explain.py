"""The current plan as JSON-able dicts (``GET /v1/plan``; the HTML page renders the same dict).

:func:`engines_json` says per engine what the controller knows (capacity, group, health and why,
the last scrape with its prefix-cache hit rate and window, the planned load);
:func:`prefix_cache_json` says the fleet's hit rate (token-weighted); :func:`plan_fields` and
:func:`classes_json` say what the plan in force does per class (demand, shed fraction, marginal
cost, allocation and weights).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from controller.learning import FleetLearning
from controller.model import FleetModel, Plan
from controller.scrape import EngineScraper
from fastroute.signals.prefix_cache import fleet_hit_rate
from fastroute.tables import FLAG_UNAVAILABLE

__all__ = ["classes_json", "engines_json", "plan_fields", "prefix_cache_json"]

FloatArray = npt.NDArray[np.float64]


def engines_json(
    learning: FleetLearning, scraper: EngineScraper, plan: Plan | None, now_s: float
) -> list[dict[str, Any]]:
    """One dict per engine of ``learning.model``, config order."""
    m = learning.model
    flags = learning.engine_flags()
    engines: list[dict[str, Any]] = []
    for i, (name, cap) in enumerate(zip(m.engine_names, m.capacity_rps, strict=True)):
        d = learning.health.state(i)
        scrape = scraper.state(i, now_s)
        engines.append(
            {
                "name": name,
                "capacity_rps": float(cap),
                "effective_capacity_rps": float(m.groups.engine_capacity_rps[i]),
                "reuse_gain": float(learning.reuse_gain[i]),
                "group": int(m.groups.group_of_engine[i]),
                "fit_group": learning.fitter.group_names[int(learning.fit_group[i])],
                "scrape": scrape,
                # flat copies for the HTML page: the last scraped gauges and their age
                "signals": {
                    k: scrape[k]
                    for k in ("running", "waiting", "kv_cache_usage")
                    if scrape[k] is not None
                }
                | _hit_rate_signal(scrape["prefix_cache"])
                | ({"stale": 1} if scrape["stale"] else {}),
                "signals_age_s": scrape["age_s"],
                "load_rps": None if plan is None else float(plan.x_rps[:, i].sum()),
                "unavailable": bool(flags[i] & FLAG_UNAVAILABLE),
                "derating": d,
                # flat copies for the HTML page (controller.plan_page)
                "health_level": d["level"],
                "health_reason": d["reason"],
                "health_since": d["since"],
            }
        )
    return engines


def _hit_rate_signal(hit: dict[str, Any]) -> dict[str, Any]:
    """The flat ``prefix_hit_rate`` entry of an engine's signals, when the rate is known."""
    return {} if hit["rate"] is None else {"prefix_hit_rate": hit["rate"]}


def prefix_cache_json(scraper: EngineScraper, now_s: float) -> dict[str, Any]:
    """The fleet's prefix-cache hit rate: token-weighted over the fresh engines' windows."""
    return fleet_hit_rate(scraper.prefix_hit_rates(now_s)).as_json()


def plan_fields(plan: Plan) -> dict[str, Any]:
    """The plan's id, generation, time, retry ratio and solve summary."""
    r = plan.result
    return {
        "plan_id": plan.plan_id,
        "generation": plan.generation,
        "created_at": plan.created_at_s,
        "retry_ratio": plan.retry_ratio,
        "solve": {
            "status": r.status,
            "objective": r.objective,
            "solve_time_s": r.solve_time_s,
            "build_time_s": r.build_time_s,
            "iterations": r.iterations,
            "warm": r.warm,
        },
    }


def classes_json(plan: Plan, model: FleetModel) -> list[dict[str, Any]]:
    """One dict per class (table row) of ``model``: what ``plan`` does with its demand."""
    return [
        {
            "name": c.name,
            "key": c.key,
            "cluster": c.cluster,
            "model": c.model,
            "priority": c.priority,
            "demand_rps": float(plan.demand_rps[g]),
            "measured": bool(plan.measured[g]),
            "shed_fraction": float(plan.shed_fraction[g]),
            "marginal_cost_s": float(plan.marginal_cost_s[g]),
            "allocation_rps": _nonzero(model.engine_names, plan.x_rps[g]),
            "weights": _nonzero(model.engine_names, plan.weights[g]),
        }
        for g, c in enumerate(model.classes)
    ]


def _nonzero(names: Sequence[str], row: FloatArray) -> dict[str, float]:
    return {n: float(v) for n, v in zip(names, row, strict=True) if v > 0}
