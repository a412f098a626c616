"""Divide tenants' fleet-wide limits among proxies, and a priority's admitted load among tenants.

Two pure allocations the controller runs every period:

* :func:`split_limit` — water-filling of one tenant's fleet-wide limit over the proxies by
  their reported demand: each proxy gets min(its demand, the fair level), the share a
  proxy does not use flows to proxies with more demand, and what no proxy asks for is
  spread evenly so a proxy whose demand rises before the next period is not starved.
  The shares always sum to the limit, so the fleet admits at most the limit.
* :func:`weighted_max_min` — when the controller sheds a class, the tenants of that
  priority share the admitted load by weighted max-min over their demand: a tenant
  asking for less than its weighted share gets all it asks; the rest is divided in
  proportion to the weights.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = ["split_limit", "weighted_max_min", "shed_fractions"]


def _check(values: Mapping[str, float], what: str) -> None:
    for key, value in values.items():
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{what} of {key!r} must be finite and >= 0, got {value!r}")


def weighted_max_min(
    capacity: float, demands: Mapping[str, float], weights: Mapping[str, float] | None = None
) -> dict[str, float]:
    """Weighted max-min fair allocation of ``capacity`` over ``demands``.

    Parameters
    ----------
    capacity : float
        What there is to give (>= 0), in the demands' unit (requests/s, req/min...).
    demands : mapping of str to float
        Each claimant's demand (>= 0).
    weights : mapping of str to float, optional
        Each claimant's weight (> 0); missing claimants weigh 1.

    Returns
    -------
    dict of str to float
        The allocation: never above a claimant's demand; sums to
        ``min(capacity, sum(demands))``; claimants held below their demand receive in
        proportion to their weights.

    Raises
    ------
    ValueError
        A negative or non-finite capacity or demand, or a weight <= 0.
    """
    if not math.isfinite(capacity) or capacity < 0:
        raise ValueError(f"capacity must be finite and >= 0, got {capacity!r}")
    _check(demands, "demand")
    w = {k: (1.0 if weights is None else float(weights.get(k, 1.0))) for k in demands}
    for key, weight in w.items():
        if not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"weight of {key!r} must be finite and > 0, got {weight!r}")
    alloc = dict.fromkeys(demands, 0.0)
    open_ = {k for k, d in demands.items() if d > 0}
    left = float(capacity)
    # Progressive filling: each round satisfies at least one claimant or spends all.
    while open_ and left > 1e-12:
        level = left / sum(w[k] for k in open_)
        full = {k for k in open_ if demands[k] - alloc[k] <= w[k] * level}
        if not full:
            for k in open_:
                alloc[k] += w[k] * level
            break
        for k in full:
            left -= demands[k] - alloc[k]
            alloc[k] = float(demands[k])
        open_ -= full
    return alloc


def split_limit(limit: float, demands: Mapping[str, float]) -> dict[str, float]:
    """Water-fill one tenant's fleet-wide ``limit`` over proxies by their ``demands``.

    Parameters
    ----------
    limit : float
        The tenant's fleet-wide limit (>= 0; requests/min, tokens/min or concurrency).
    demands : mapping of str to float
        Each proxy's demand for the tenant in the limit's unit over the last period.

    Returns
    -------
    dict of str to float
        Per proxy share: max-min fair over the demands, plus an even part of what no
        proxy asked for; the shares sum to ``limit`` (when there is at least one proxy).
    """
    shares = weighted_max_min(limit, demands)
    if not shares:
        return shares
    spare = max(0.0, limit - sum(shares.values())) / len(shares)
    return {k: v + spare for k, v in shares.items()}


def shed_fractions(
    admitted_total: float, demands: Mapping[str, float], weights: Mapping[str, float]
) -> dict[str, float]:
    """Per-tenant shed fractions when a priority can admit only ``admitted_total``.

    Parameters
    ----------
    admitted_total : float
        The load the priority's class may admit (its demand times one minus the
        controller's shed fraction).
    demands, weights : mapping of str to float
        The tenants' demands and weights (see :func:`weighted_max_min`).

    Returns
    -------
    dict of str to float
        For each tenant with demand, the fraction of its requests to shed, in [0, 1].
    """
    alloc = weighted_max_min(admitted_total, demands, weights)
    return {k: min(1.0, max(0.0, 1.0 - alloc[k] / d)) for k, d in demands.items() if d > 0}
