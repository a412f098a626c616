"""Per-tenant limits and fair shedding on the request path.

The proxy's share of each tenant's fleet-wide limits comes from the controller's table
(``meta["tenant_limits"][proxy_id]``), or, without one, is the configured limit divided
by ``proxy.proxy_count``. Requests are counted in the host's shared
:class:`~fastroute.tables.tenant_limits.TenantLimitBlock`, so all workers enforce one
share. A tenant over its share gets 429 ``rate_limit_exceeded`` with ``Retry-After`` and
OpenAI's ``x-ratelimit-*`` headers; admitted requests carry the same headers.

When the controller sheds a class, ``meta["tenant_shed"][tenant]`` is the tenant's own
shed fraction inside its priority (weighted max-min, :mod:`controller.tenant_shares`);
the handler sheds by it instead of the class's.

The per-tenant demand of this worker (requests and estimated tokens offered, refused
ones included) goes into its report (``DemandAggregator.observe_tenant``) for the
controller's split.
"""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass
from typing import Any

from fastroute.config import Config, TenantConfig
from fastroute.proxy.http.openai_errors import error_reply
from fastroute.proxy.http.ratelimit import RateLimitState, duration_string, ratelimit_headers
from fastroute.proxy.http.reply import Reply
from fastroute.proxy.path.routing_key import estimate_prompt_tokens
from fastroute.signals.reports import completion_tokens_of
from fastroute.tables.tenant_limits import WINDOW_S, Charge, SlotLimits, TenantLimitBlock

__all__ = [
    "TenantLimiter",
    "TenantAdmission",
    "static_limits",
    "proxy_id",
    "tenant_admit",
    "tenant_demand",
    "tenant_done",
]


def proxy_id(config: Config) -> str:
    """This proxy's key for its tenant shares: host and port (unique in a fleet)."""
    return f"{socket.gethostname()}:{config.proxy.port}"


def static_limits(tenant: TenantConfig, proxy_count: int) -> SlotLimits:
    """A tenant's limits divided evenly over ``proxy_count`` proxies (no controller)."""
    conc = tenant.max_concurrent
    return SlotLimits(
        requests_per_min=None
        if tenant.requests_per_min is None
        else tenant.requests_per_min / proxy_count,
        tokens_per_min=None
        if tenant.tokens_per_min is None
        else tenant.tokens_per_min / proxy_count,
        max_concurrent=None if conc is None else max(1, math.ceil(conc / proxy_count)),
    )


def _limited(tenant: TenantConfig) -> bool:
    return (
        tenant.requests_per_min is not None
        or tenant.tokens_per_min is not None
        or tenant.max_concurrent is not None
    )


@dataclass(slots=True)
class TenantAdmission:
    """An admitted request's charge and its headers for the client.

    Attributes
    ----------
    charge : Charge
        Returned to :meth:`TenantLimiter.finish` on every exit path.
    headers : dict of str to str
        ``x-ratelimit-*`` of the tenant at admission.
    """

    charge: Charge
    headers: dict[str, str]


class TenantLimiter:
    """Enforce this proxy's share of each tenant's limits.

    Parameters
    ----------
    config : Config
    block : TenantLimitBlock
        The host's shared counters (one slot per tenant, in config order).
    proxy_id : str
        This proxy's key in the controller's ``meta["tenant_limits"]``.
    metrics : ProxyMetrics
        Where admitted/rejected counts go.
    """

    def __init__(
        self, config: Config, block: TenantLimitBlock, proxy_id: str, metrics: Any
    ) -> None:
        self.block = block
        self.proxy_id = proxy_id
        self.metrics = metrics
        count = config.proxy.proxy_count
        self._slot = {t.name: i for i, t in enumerate(config.tenants) if i < block.n_tenants}
        self._static = {t.name: static_limits(t, count) for t in config.tenants if _limited(t)}
        self._limits: dict[str, SlotLimits] = dict(self._static)
        self._shed: dict[str, float] = {}
        self._generation = -1

    def follow(self, generation: int, tenant_meta: dict[str, Any]) -> None:
        """Adopt the shares of a new table generation (cheap when it did not change)."""
        if generation == self._generation:
            return
        self._generation = generation
        mine = tenant_meta.get("tenant_limits", {}).get(self.proxy_id)
        limits = dict(self._static)
        if isinstance(mine, dict):
            for name, share in mine.items():
                if name in self._static and isinstance(share, list) and len(share) == 3:
                    rpm, tpm, conc = share
                    limits[name] = SlotLimits(
                        requests_per_min=rpm,
                        tokens_per_min=tpm,
                        max_concurrent=None if conc is None else max(1, int(conc)),
                    )
        self._limits = limits
        shed = tenant_meta.get("tenant_shed", {})
        self._shed = {k: float(v) for k, v in shed.items()} if isinstance(shed, dict) else {}

    def shed_fraction(self, tenant: str, class_fraction: float) -> float:
        """The tenant's own shed fraction when the controller published one."""
        return self._shed.get(tenant, class_fraction)

    def admit(self, tenant: str, tokens: int) -> TenantAdmission | Reply | None:
        """Count a request of ``tenant`` (``tokens`` estimated prompt + output).

        Returns
        -------
        TenantAdmission, Reply or None
            The admission to :meth:`finish`; the 429 to answer; None when the tenant
            has no limits (nothing to count).
        """
        limits = self._limits.get(tenant)
        if limits is None:
            return None
        slot = self._slot[tenant]
        charge = self.block.admit(slot, tokens, limits)
        if isinstance(charge, Charge):
            self.metrics.tenant_admitted.labels(tenant).inc()
            return TenantAdmission(charge, self._headers(slot, limits))
        self.metrics.tenant_rejected.labels(tenant, charge).inc()
        return self._refusal(tenant, slot, limits, charge)

    def finish(self, admission: TenantAdmission, used_tokens: int | None) -> None:
        """Release the in-flight unit and correct the tokens to what the engine used."""
        self.block.finish(admission.charge, used_tokens)

    def _state(self, slot: int, limits: SlotLimits) -> RateLimitState:
        usage = self.block.usage(slot)
        rpm, tpm = limits.requests_per_min, limits.tokens_per_min
        return RateLimitState(
            limit_requests=None if rpm is None else int(rpm),
            remaining_requests=None if rpm is None else int(rpm - usage.requests),
            limit_tokens=None if tpm is None else int(tpm),
            remaining_tokens=None if tpm is None else int(tpm - usage.tokens),
            reset_s=usage.oldest_window_s,
        )

    def _headers(self, slot: int, limits: SlotLimits) -> dict[str, str]:
        return ratelimit_headers(self._state(slot, limits))

    def _refusal(self, tenant: str, slot: int, limits: SlotLimits, which: str) -> Reply:
        state = self._state(slot, limits)
        headers = ratelimit_headers(state)
        # Concurrency frees when a request ends; a sub-window is the next time a rate
        # limit can give room back.
        retry_s = WINDOW_S if which == "concurrent" else max(state.reset_s, 1.0)
        headers["Retry-After"] = str(max(1, math.ceil(retry_s)))
        what = {
            "requests": f"requests per minute ({state.limit_requests} on this proxy)",
            "tokens": f"tokens per minute ({state.limit_tokens} on this proxy)",
            "concurrent": f"concurrent requests ({limits.max_concurrent} on this proxy)",
        }[which]
        return error_reply(
            429,
            f"Rate limit reached for tenant {tenant!r}: {what}; "
            f"retry in {duration_string(retry_s)}.",
            code="rate_limit_exceeded",
            headers=headers,
        )


def tenant_demand(ctx: Any, state: Any) -> int:
    """The request's estimated tokens (prompt + ``max_tokens``), counted as its tenant's
    offered demand in the controller's report (before any shed or refusal)."""
    parsed = state.parsed
    tokens = estimate_prompt_tokens(parsed) + (parsed.max_output_tokens or 0)
    if ctx.aggregator is not None and state.tenant:
        ctx.aggregator.observe_tenant(state.tenant, state.priority, tokens)
    return int(tokens)


def tenant_admit(ctx: Any, limiter: TenantLimiter, state: Any, tokens: int) -> Reply | None:
    """Count ``state``'s request (``tokens`` estimated) against its tenant's share; the
    429 if it is over."""
    got = limiter.admit(state.tenant, tokens)
    if isinstance(got, Reply):
        state.record.error = "tenant rate limit"
        ctx.metrics.shed.labels(state.cls.name, "tenant_limit").inc()
        return got
    state.tenant_admission = got
    return None


def tenant_done(limiter: TenantLimiter | None, state: Any, response: Reply | None) -> Reply | None:
    """Give back the request's tenant charge, correct its tokens, and add the headers to
    a whole answer (a stream's headers are already sent)."""
    admission: TenantAdmission = state.tenant_admission
    state.tenant_admission = None
    if limiter is None:
        return response
    used: int | None = None
    out = [a.output_tokens for a in state.record.attempts if a.output_tokens is not None]
    if out:
        used = sum(out)
    elif response is not None and not response.streamed and response.status < 400:
        used = completion_tokens_of(response.body)
    if used is not None and state.parsed is not None:
        used += estimate_prompt_tokens(state.parsed)
    limiter.finish(admission, used)
    if response is not None and not response.streamed and admission.headers:
        response.headers = [*response.headers, *admission.headers.items()]
    return response
