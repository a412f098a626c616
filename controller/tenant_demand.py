"""Per-tenant demand from the proxies' reports, and the tenant entries of the table's meta.

Each report carries the worker's per-tenant requests and estimated tokens
(:class:`fastroute.signals.reports.TenantDemand`). :class:`TenantBoard` sums them per
proxy (``Report.proxy_id``) and per tenant and priority over the controller's period,
smooths them with an EWMA, and every period computes

* ``meta["tenant_limits"]`` — ``{proxy_id: {tenant: [requests_per_min, tokens_per_min,
  max_concurrent]}}``: each tenant's fleet-wide limits water-filled over the live
  proxies by their demand (:func:`controller.tenant_shares.split_limit`);
* ``meta["tenant_shed"]`` — ``{tenant: fraction}``: when the plan sheds a priority, the
  tenants of that priority share what is admitted by weighted max-min over their demand
  (:func:`controller.tenant_shares.shed_fractions`).

Bounds: proxies and (tenant, priority) pairs are bounded by ``MAX_PROXIES`` and the
config's tenants; a proxy silent for ``STALE_AFTER_PERIODS`` periods is dropped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import msgspec

from controller.tenant_shares import shed_fractions, split_limit
from fastroute.config import Config, TenantConfig
from fastroute.signals.reports import Report
from fastroute.tables.layout import META_MAX_BYTES

__all__ = ["TenantBoard", "MAX_PROXIES", "STALE_AFTER_PERIODS", "DEMAND_ALPHA"]

log = logging.getLogger(__name__)

#: Proxies tracked at most (bounds the board and the meta's size).
MAX_PROXIES = 256
#: Periods without a report after which a proxy's share goes back to the others.
STALE_AFTER_PERIODS = 5
#: Weight of the new period in the demand EWMA: 0.5 follows a shift of demand between
#: proxies within two or three periods while damping one period's noise.
DEMAND_ALPHA = 0.5
#: Room left in the meta for the controller's other keys (plan id, status, epoch...).
_META_HEADROOM_BYTES = 1024


def _limited(t: TenantConfig) -> bool:
    return (
        t.requests_per_min is not None
        or t.tokens_per_min is not None
        or t.max_concurrent is not None
    )


@dataclass
class _Proxy:
    last_period: int
    pending: dict[str, list[int]] = field(default_factory=dict)  # tenant -> [requests, tokens]
    rate: dict[str, list[float]] = field(default_factory=dict)  # tenant -> [req/min, tok/min]


class TenantBoard:
    """Per-proxy, per-tenant demand and the shares computed from it.

    Parameters
    ----------
    config : Config
        Its tenants (limits, weights).
    period_s : float
        The controller's period (the demand window).
    """

    def __init__(self, config: Config, period_s: float) -> None:
        self.period_s = period_s
        self.tenants = {t.name: t for t in config.tenants}
        self._limited = [t for t in config.tenants if _limited(t)]
        self._proxies: dict[str, _Proxy] = {}
        self._period = 0
        self._pending_prio: dict[tuple[str, str], int] = {}
        self.priority_rate: dict[tuple[str, str], float] = {}  # (tenant, priority) -> req/s
        self.dropped_reports = 0
        self.last_meta: dict[str, Any] = {}
        self.last_shed: dict[str, float] = {}

    def observe(self, report: Report) -> None:
        """Add one report's per-tenant counts (reports without a proxy id are ignored)."""
        if not report.tenants or not report.proxy_id:
            return
        p = self._proxies.get(report.proxy_id)
        if p is None:
            if len(self._proxies) >= MAX_PROXIES:
                self.dropped_reports += 1
                return
            p = self._proxies[report.proxy_id] = _Proxy(self._period)
        p.last_period = self._period
        for d in report.tenants:
            if d.tenant not in self.tenants:
                continue
            acc = p.pending.setdefault(d.tenant, [0, 0])
            acc[0] += d.requests
            acc[1] += d.tokens
            key = (d.tenant, d.priority)
            self._pending_prio[key] = self._pending_prio.get(key, 0) + d.requests

    def close_period(self) -> None:
        """Fold the period's counts into the EWMAs; forget stale proxies."""
        per_min = 60.0 / self.period_s
        for pid, p in list(self._proxies.items()):
            if self._period - p.last_period > STALE_AFTER_PERIODS:
                del self._proxies[pid]
                continue
            for name in set(p.rate) | set(p.pending):
                req, tok = p.pending.get(name, (0, 0))
                old = p.rate.get(name)
                new = [req * per_min, tok * per_min]
                p.rate[name] = (
                    new
                    if old is None
                    else [o + DEMAND_ALPHA * (n - o) for o, n in zip(old, new, strict=True)]
                )
            p.pending = {}
        for key in set(self.priority_rate) | set(self._pending_prio):
            new = self._pending_prio.get(key, 0) / self.period_s
            old = self.priority_rate.get(key)
            self.priority_rate[key] = new if old is None else old + DEMAND_ALPHA * (new - old)
        self._pending_prio = {}
        self._period += 1

    def limits_meta(self) -> dict[str, dict[str, list[Any]]]:
        """``meta["tenant_limits"]``: each limited tenant's limits split over the proxies."""
        out: dict[str, dict[str, list[Any]]] = {pid: {} for pid in self._proxies}
        if not self._proxies:
            return {}
        for t in self._limited:
            req = {pid: p.rate.get(t.name, [0.0, 0.0])[0] for pid, p in self._proxies.items()}
            tok = {pid: p.rate.get(t.name, [0.0, 0.0])[1] for pid, p in self._proxies.items()}
            rpm = split_limit(t.requests_per_min, req) if t.requests_per_min else None
            tpm = split_limit(t.tokens_per_min, tok) if t.tokens_per_min else None
            # In flight follows the request rate (Little's law at equal latency).
            conc = split_limit(t.max_concurrent, req) if t.max_concurrent else None
            for pid in self._proxies:
                out[pid][t.name] = [
                    None if rpm is None else round(rpm[pid], 2),
                    None if tpm is None else round(tpm[pid]),
                    None if conc is None else max(1, round(conc[pid])),
                ]
        return out

    def shed_meta(self, shed_by_priority: dict[str, float]) -> dict[str, float]:
        """``meta["tenant_shed"]``: per tenant, its fraction to shed inside its priority.

        Parameters
        ----------
        shed_by_priority : dict of str to float
            The plan's demand-weighted shed fraction of each priority (0 when not shed).
        """
        out: dict[str, float] = {}
        for prio, sigma in shed_by_priority.items():
            if sigma <= 1e-9:
                continue
            demands = {t: r for (t, p), r in self.priority_rate.items() if p == prio and r > 0}
            if not demands:
                continue
            weights = {t: self.tenants[t].weight for t in demands}
            admitted = (1.0 - sigma) * sum(demands.values())
            for t, f in shed_fractions(admitted, demands, weights).items():
                out[t] = round(f, 4)
        self.last_shed = out
        return out

    def meta(self, shed_by_priority: dict[str, float]) -> dict[str, Any]:
        """The tenant entries of the next table's meta (omitted parts: proxies fall back
        to ``limit / proxy.proxy_count`` and the class's shed fraction)."""
        meta: dict[str, Any] = {}
        limits = self.limits_meta()
        if limits:
            meta["tenant_limits"] = limits
        shed = self.shed_meta(shed_by_priority)
        if shed:
            meta["tenant_shed"] = shed
        if len(msgspec.msgpack.encode(meta)) > META_MAX_BYTES - _META_HEADROOM_BYTES:
            log.warning("tenant shares do not fit the table meta: proxies use their static split")
            meta.pop("tenant_limits", None)
        self.last_meta = meta
        return meta

    def plan_json(self) -> list[dict[str, Any]]:
        """Per tenant and priority: demand, and admitted/shed (req/s) in the last plan."""
        rows = []
        for (tenant, prio), rate in sorted(self.priority_rate.items()):
            f = self.last_shed.get(tenant, 0.0)
            rows.append(
                {
                    "tenant": tenant,
                    "priority": prio,
                    "weight": self.tenants[tenant].weight,
                    "demand_rps": rate,
                    "admitted_rps": rate * (1 - f),
                    "shed_rps": rate * f,
                    "shed_fraction": f,
                }
            )
        return rows
