"""Wiring of the ``marginal-cost`` policy into a proxy context.

One :class:`~fastroute.policy.marginal.MarginalCost` instance serves every class
whose policy is ``marginal-cost``: whole requests, and both pools of a P/D model
(its prefix tree must see the prompts routed to both engines of a pair, and engine
ids differ between pools). :func:`install_marginal`

* gives the policy the previous context's calibration and output-length histograms
  (a config reload keeps what was learned);
* attaches an :class:`~fastroute.proxy.path.engine_load.EngineLoad` to the fleet (and to
  each P/D pool), which the request path uses only for ``marginal-cost`` classes;
* makes the P/D pair selector :class:`~fastroute.policy.marginal.MarginalPairs`;
* points ``/metrics`` at the calibration.
"""

from __future__ import annotations

from fastroute.policy.marginal import MarginalCost, MarginalPairs
from fastroute.proxy.path.engine_load import EngineLoad
from fastroute.proxy.path.handler import ProxyContext

__all__ = ["MARGINAL", "attach_scraper", "install_marginal"]

#: The policy name.
MARGINAL = MarginalCost.name


def install_marginal(ctx: ProxyContext, previous: ProxyContext | None = None) -> None:
    """Wire ``ctx``'s ``marginal-cost`` policy, if its config uses one (else no-op)."""
    policy = ctx.policies.get(MARGINAL)
    if not isinstance(policy, MarginalCost):
        ctx.metrics.calibration = None
        return
    old = previous.policies.get(MARGINAL) if previous is not None else None
    if isinstance(old, MarginalCost):
        policy.calibration = old.calibration
        policy.output_lengths = old.output_lengths
    ctx.fleet.load = EngineLoad(ctx.fleet.engines, policy, ctx.scraper)
    pd = ctx.pd
    if pd is not None:
        pd.prefill_policies[MARGINAL] = policy
        pd.decode_policies[MARGINAL] = policy
        pd.set_selector(MARGINAL, MarginalPairs(policy))
        pd.prefill.load = EngineLoad(pd.prefill.engines, policy, ctx.scraper)
        pd.decode.load = EngineLoad(pd.decode.engines, policy, ctx.scraper)
    ctx.metrics.calibration = policy.calibration


def attach_scraper(ctx: ProxyContext, scraper: object) -> None:
    """Let every engine load of ``ctx`` merge ``scraper``'s results."""
    ctx.scraper = scraper
    fleets = [ctx.fleet]
    if ctx.pd is not None:
        fleets += [ctx.pd.prefill, ctx.pd.decode]
    for fleet in fleets:
        if fleet.load is not None:
            fleet.load.scraper = scraper  # type: ignore[assignment]
