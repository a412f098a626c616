"""How a class's policy is applied to a fleet: one :class:`RoutingStrategy` per policy
name and fleet, built once per handler.

A strategy says how to build the policy's request, which view of the fleet it decides
over, how to decide, what it adds to the decision record and how an attempt is tracked.
:class:`PlainStrategy` is every policy's: a :class:`~fastroute.policy.RouteRequest`
over :meth:`Fleet.view <fastroute.proxy.path.fleet.Fleet.view>`, nothing tracked.
:class:`MarginalStrategy` is ``marginal-cost``'s: the request carries the SLOs (read
from the headers), the view has engine state (:meth:`Fleet.load_view
<fastroute.proxy.path.fleet.Fleet.load_view>`), a request found SLO-infeasible before the
calibration has enough samples is routed without its SLO, else it gets an early 429
``slo_infeasible``; the prediction goes into the decision record and every attempt is
tracked in the fleet's :class:`~fastroute.proxy.path.engine_load.EngineLoad` (its timings
calibrate the policy).

P/D requests decide a pair through a :class:`PairStrategy` (the pools' strategies plus
the pair selector; :class:`MarginalPairStrategy` for ``marginal-cost``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import msgspec
import numpy as np

from fastroute.policy import Decision, Policy, RouteRequest
from fastroute.policy.marginal import REASON_SLO_INFEASIBLE, MarginalCost, MarginalRequest
from fastroute.proxy.http.openai_errors import error_reply
from fastroute.proxy.http.reply import Reply
from fastroute.proxy.path.classify import key_depth_bytes
from fastroute.proxy.path.engine_load import AttemptLoad, EngineLoad
from fastroute.proxy.path.records import prediction, unenforced
from fastroute.proxy.path.request_state import RequestState

if TYPE_CHECKING:
    from fastroute.proxy.path.fleet import Fleet, RequestView
    from fastroute.proxy.path.handler import ProxyContext
    from fastroute.proxy.path.pd import PairSelector

__all__ = [
    "RoutingStrategy",
    "PlainStrategy",
    "MarginalStrategy",
    "PairStrategy",
    "MarginalPairStrategy",
    "build_strategies",
    "build_pair_strategies",
]


class RoutingStrategy(Protocol):
    """A policy applied to one fleet (see the module docstring).

    Attributes
    ----------
    name : str
        The policy name.
    fleet : Fleet
    policy : Policy
        Told of every attempt (``on_routed``/``on_complete``).
    reads_slos : bool
        Whether requests routed by it carry SLOs (read from their headers).
    """

    name: str
    fleet: Fleet
    policy: Policy
    reads_slos: bool

    def view(self, mask: np.ndarray) -> RequestView:
        """The view of the fleet one request decides over."""

    def route(
        self, state: RequestState, row: int, prompt_tokens: int, prefix: bytes
    ) -> RouteRequest:
        """The policy's request for ``state`` in class row ``row`` of the fleet."""

    def decide(self, state: RequestState, view: RequestView) -> Decision:
        """The first decision for ``state.route`` (may replace ``state.route``)."""

    def choose(self, state: RequestState, view: RequestView) -> Decision:
        """Decide again for ``state.route`` (after waiting for a capped engine)."""

    def record(self, state: RequestState, decision: Decision) -> Reply | None:
        """Add the strategy's part to the decision record; a response to refuse with."""

    def admit(
        self, index: int, route: RouteRequest, now_s: float, stage: str | None
    ) -> AttemptLoad | None:
        """An attempt to engine ``index`` starts: its tracker, if the strategy tracks."""

    def release(self, tracked: AttemptLoad, ok: bool, now_s: float) -> None:
        """A tracked attempt ended."""


class PlainStrategy:
    """A policy over :meth:`Fleet.view`, with nothing tracked (every policy but
    ``marginal-cost``)."""

    __slots__ = ("name", "fleet", "policy", "top_k")

    reads_slos = False

    def __init__(self, name: str, fleet: Fleet, policy: Policy, top_k: int) -> None:
        self.name = name
        self.fleet = fleet
        self.policy = policy
        self.top_k = top_k

    def view(self, mask: np.ndarray) -> RequestView:
        return self.fleet.view(mask)

    def route(
        self, state: RequestState, row: int, prompt_tokens: int, prefix: bytes
    ) -> RouteRequest:
        parsed = state.parsed
        budget = parsed.max_output_tokens if parsed is not None else None
        depth = -1
        if prefix and parsed is not None:
            depth = key_depth_bytes(parsed, state.record.key_source)
        return RouteRequest(
            key_hash=state.key,
            row=row,
            prompt_tokens=prompt_tokens,
            prefix=prefix,
            expected_output_tokens=budget,
            key_depth_bytes=depth,
        )

    def choose(self, state: RequestState, view: RequestView) -> Decision:
        route = state.route
        assert route is not None
        return self.policy.choose(route, view, k=self.top_k)

    decide = choose  # one decision, no second look

    def record(self, state: RequestState, decision: Decision) -> Reply | None:
        return None

    def admit(
        self, index: int, route: RouteRequest, now_s: float, stage: str | None
    ) -> AttemptLoad | None:
        return None

    def release(self, tracked: AttemptLoad, ok: bool, now_s: float) -> None:
        return None


def slo_infeasible(state: RequestState, decision: Decision, ctx: ProxyContext) -> Reply:
    """429 for a request no engine is predicted to serve within its SLO (early:
    nothing is forwarded)."""
    assert state.cls is not None
    record = state.record
    detail = getattr(decision, "detail", "") or "no engine is predicted to meet the SLO"
    record.error = f"{REASON_SLO_INFEASIBLE}: {detail}"
    ctx.metrics.shed.labels(state.cls.name, REASON_SLO_INFEASIBLE).inc()
    return error_reply(
        429,
        f"No engine for model `{state.model}` is predicted to meet the request's latency "
        f"objective ({REASON_SLO_INFEASIBLE}): {detail}. Retry later or relax the SLO.",
        code="slo_infeasible",
        headers={
            "Retry-After": str(ctx.config.admission.retry_after_s),
            "x-fastroute-engine": "none",
            "x-fastroute-decision": record.header(),
        },
    )


class MarginalStrategy(PlainStrategy):
    """``marginal-cost`` over a fleet with an :class:`EngineLoad` (see the module
    docstring).

    Parameters
    ----------
    name : str
    fleet : Fleet
        Its ``load`` is the engine state decided over and the attempts' tracker.
    policy : MarginalCost
    ctx : ProxyContext
        For the 429's metrics and ``Retry-After``, and ``policy.top_k``.
    """

    __slots__ = ("load", "ctx")

    reads_slos = True

    def __init__(self, name: str, fleet: Fleet, policy: MarginalCost, ctx: ProxyContext) -> None:
        super().__init__(name, fleet, policy, ctx.config.policy.top_k)
        assert fleet.load is not None
        self.load: EngineLoad = fleet.load
        self.ctx = ctx

    def view(self, mask: np.ndarray) -> RequestView:
        return self.fleet.load_view(mask)

    def route(
        self, state: RequestState, row: int, prompt_tokens: int, prefix: bytes
    ) -> RouteRequest:
        return MarginalRequest(
            key_hash=state.key,
            row=row,
            prompt_tokens=prompt_tokens,
            prefix=prefix,
            tenant=state.tenant or None,
            slo_ttft_s=state.slo_ttft_s,
            slo_tpot_s=state.slo_tpot_s,
        )

    def decide(self, state: RequestState, view: RequestView) -> Decision:
        decision = self.choose(state, view)
        if decision.reason == REASON_SLO_INFEASIBLE and not self.load.calibrated():
            # Not calibrated yet: a reject would rest on nominal constants, and would
            # never let them calibrate. Route best-effort, without the SLO.
            self.load.policy.reject_bound(state.route).withdraw()
            state.unenforced = decision
            state.route = msgspec.structs.replace(state.route, slo_ttft_s=None, slo_tpot_s=None)
            decision = self.choose(state, view)
        return decision

    def record(self, state: RequestState, decision: Decision) -> Reply | None:
        out = state.record.prediction = prediction(decision, self.load, decision.ranked)
        if state.unenforced is not None:
            out["slo_unenforced"] = unenforced(state.unenforced)
        if decision.reason == REASON_SLO_INFEASIBLE:
            return slo_infeasible(state, decision, self.ctx)
        return None

    def admit(
        self, index: int, route: RouteRequest, now_s: float, stage: str | None
    ) -> AttemptLoad | None:
        return self.load.admit(index, route, now_s, decode_stage=stage == "decode")

    def release(self, tracked: AttemptLoad, ok: bool, now_s: float) -> None:
        self.load.release(tracked, ok, now_s)


class PairStrategy:
    """A P/D pair decision: each pool's strategy plus the pool's pair selector.

    Parameters
    ----------
    prefill, decode : RoutingStrategy
        Over the prefill and the decode pool.
    selector : PairSelector
    top_k : int
    """

    __slots__ = ("prefill", "decode", "selector", "top_k")

    def __init__(
        self,
        prefill: RoutingStrategy,
        decode: RoutingStrategy,
        selector: PairSelector,
        top_k: int,
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.selector = selector
        self.top_k = top_k

    def decide(
        self,
        state: RequestState,
        p_route: RouteRequest,
        d_route: RouteRequest,
        p_view: RequestView,
        d_view: RequestView,
    ) -> tuple[Decision, Decision, RouteRequest, RouteRequest]:
        """(prefill, decode) decisions and the requests they were made for."""
        p_dec, d_dec = self.selector.choose_pair(p_route, d_route, p_view, d_view, self.top_k)
        return p_dec, d_dec, p_route, d_route

    def record(self, state: RequestState, p_dec: Decision, d_dec: Decision) -> Reply | None:
        """Add the strategy's part to the decision record; a response to refuse with."""
        return None


class MarginalPairStrategy(PairStrategy):
    """``marginal-cost`` pairs: the uncalibrated rule over both pools' calibration, the
    per-stage and pair predictions in the record, 429 when no pair meets the SLO."""

    __slots__ = ("ctx", "p_load", "d_load")

    def __init__(
        self,
        prefill: MarginalStrategy,
        decode: MarginalStrategy,
        selector: PairSelector,
        ctx: ProxyContext,
    ) -> None:
        super().__init__(prefill, decode, selector, ctx.config.policy.top_k)
        self.ctx = ctx
        self.p_load = prefill.load
        self.d_load = decode.load

    def decide(
        self,
        state: RequestState,
        p_route: RouteRequest,
        d_route: RouteRequest,
        p_view: RequestView,
        d_view: RequestView,
    ) -> tuple[Decision, Decision, RouteRequest, RouteRequest]:
        p_load, d_load = self.p_load, self.d_load
        p_dec, d_dec = self.selector.choose_pair(p_route, d_route, p_view, d_view, self.top_k)
        if p_dec.reason == REASON_SLO_INFEASIBLE and not (
            p_load.calibrated(("prefill",)) and d_load.calibrated(("decode",))
        ):
            p_load.policy.reject_bound(p_route).withdraw()
            state.unenforced = p_dec  # not calibrated yet: best-effort (MarginalStrategy)
            p_route = msgspec.structs.replace(p_route, slo_ttft_s=None, slo_tpot_s=None)
            d_route = msgspec.structs.replace(d_route, slo_ttft_s=None, slo_tpot_s=None)
            p_dec, d_dec = self.selector.choose_pair(p_route, d_route, p_view, d_view, self.top_k)
        return p_dec, d_dec, p_route, d_route

    def record(self, state: RequestState, p_dec: Decision, d_dec: Decision) -> Reply | None:
        p_load, d_load = self.p_load, self.d_load
        out = state.record.prediction = {
            "prefill": prediction(p_dec, p_load, p_dec.ranked),
            "decode": prediction(d_dec, d_load, d_dec.ranked),
        }
        pair = getattr(self.selector, "last", None)  # MarginalPairs keeps its last pair
        if pair is not None:
            out.update(
                ttft_s=pair.ttft_s,
                tpot_s=pair.tpot_s,
                transfer_s=pair.transfer_s,
                cost_s=pair.cost_s,
                output_tokens=pair.output_tokens,
            )
        if state.unenforced is not None:
            out["slo_unenforced"] = unenforced(state.unenforced)
        if p_dec.reason == REASON_SLO_INFEASIBLE:
            return slo_infeasible(state, p_dec, self.ctx)
        return None


def _strategy(name: str, fleet: Fleet, policy: Policy, ctx: ProxyContext) -> RoutingStrategy:
    if isinstance(policy, MarginalCost) and fleet.load is not None:
        return MarginalStrategy(name, fleet, policy, ctx)
    return PlainStrategy(name, fleet, policy, ctx.config.policy.top_k)


def build_strategies(ctx: ProxyContext) -> dict[str, RoutingStrategy]:
    """One strategy per policy name over the context's main fleet."""
    return {name: _strategy(name, ctx.fleet, p, ctx) for name, p in ctx.policies.items()}


def build_pair_strategies(ctx: ProxyContext) -> dict[str, PairStrategy]:
    """One pair strategy per policy name over the context's P/D pools (none without)."""
    pd = ctx.pd
    if pd is None:
        return {}
    out: dict[str, PairStrategy] = {}
    for name, p_policy in pd.prefill_policies.items():
        prefill = _strategy(name, pd.prefill, p_policy, ctx)
        decode = _strategy(name, pd.decode, pd.decode_policies[name], ctx)
        selector = pd.selector(name)
        if isinstance(prefill, MarginalStrategy) and isinstance(decode, MarginalStrategy):
            out[name] = MarginalPairStrategy(prefill, decode, selector, ctx)
        else:
            out[name] = PairStrategy(prefill, decode, selector, ctx.config.policy.top_k)
    return out
