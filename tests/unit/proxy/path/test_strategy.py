"""Routing strategies in isolation: what each builds, decides over, records and tracks."""

from __future__ import annotations

import msgspec

from fastroute.config import decode_config
from fastroute.policy import RouteRequest
from fastroute.policy.marginal import REASON_SLO_INFEASIBLE, MarginalPairs, MarginalRequest
from fastroute.proxy.path.decisions import DecisionRecord
from fastroute.proxy.path.handler import ProxyContext
from fastroute.proxy.path.request_state import RequestState
from fastroute.proxy.path.strategy import (
    MarginalPairStrategy,
    MarginalStrategy,
    PairStrategy,
    PlainStrategy,
    build_pair_strategies,
    build_strategies,
)
from fastroute.proxy.proxy_app import build_context

_COLOCATED = "".join(
    f'[[engines]]\nname = "e{i}"\nurl = "http://127.0.0.1:{9000 + i}"\nmodels = ["m"]\n'
    'hardware = "h100"\ncapacity_rps = 10.0\n\n'
    for i in range(2)
)
_ENGINES = _COLOCATED + (
    '[[engines]]\nname = "p0"\nurl = "http://127.0.0.1:9101"\nmodels = ["pd"]\nrole = "prefill"\n\n'
    '[[engines]]\nname = "d0"\nurl = "http://127.0.0.1:9102"\nmodels = ["pd"]\nrole = "decode"\n\n'
)
_MARGINAL = _ENGINES + '[policy]\ndefault = "marginal-cost"\n'


def _state(ctx: ProxyContext, slo_ttft_s: float | None = None) -> RequestState:
    record = DecisionRecord(request_id="r1", endpoint="/v1/completions")
    state = RequestState(None, "completions", b"{}", None, record, None, 0.0)  # type: ignore[arg-type]
    state.model, state.priority, state.key = "m", "default", 12345
    state.cls = ctx.config.class_for("m", "default")
    state.row = ctx.fleet.rows[("m", "default")]
    state.zones = frozenset({"default"})
    state.slo_ttft_s = slo_ttft_s
    return state


def _decide(ctx: ProxyContext, state: RequestState, name: str) -> tuple[object, object]:
    strategy = build_strategies(ctx)[name]
    view = strategy.view(ctx.fleet.eligibility.request_mask(state.zones, None))
    state.route = strategy.route(state, state.row, 100, b"")
    return strategy, strategy.decide(state, view)


def test_a_plain_strategy_is_its_policy_over_the_fleet_view_with_nothing_tracked() -> None:
    ctx = build_context(decode_config(_ENGINES), None, None)
    name = ctx.config.policy.default
    state = _state(ctx)
    strategy, decision = _decide(ctx, state, name)
    assert isinstance(strategy, PlainStrategy) and not isinstance(strategy, MarginalStrategy)
    assert not strategy.reads_slos and strategy.policy is ctx.policies[name]
    assert type(state.route) is RouteRequest and state.route.key_hash == 12345
    view = ctx.fleet.view(ctx.fleet.eligibility.request_mask(state.zones, None))
    again = ctx.policies[name].choose(state.route, view, k=ctx.config.policy.top_k)
    assert list(decision.ranked) == list(again.ranked) and len(decision.ranked) == 2
    assert strategy.record(state, decision) is None and state.record.prediction is None
    assert strategy.admit(0, state.route, 1.0, None) is None


def test_marginal_routes_an_infeasible_request_without_its_slo_until_calibrated() -> None:
    ctx = build_context(decode_config(_MARGINAL), None, None)
    state = _state(ctx, slo_ttft_s=1e-9)
    strategy, decision = _decide(ctx, state, "marginal-cost")
    assert isinstance(strategy, MarginalStrategy) and strategy.reads_slos
    assert isinstance(state.route, MarginalRequest) and state.route.slo_ttft_s is None
    assert state.unenforced is not None and state.unenforced.reason == REASON_SLO_INFEASIBLE
    assert decision.reason != REASON_SLO_INFEASIBLE and decision.ranked
    assert strategy.record(state, decision) is None
    prediction = state.record.prediction
    assert prediction is not None and "slo_unenforced" in prediction
    assert prediction["calibration_samples"] == {"h100": {"prefill": 0, "decode": 0}}
    # The rejection the first look recorded was not carried out: the bound forgets it.
    asked = msgspec.structs.replace(state.route, slo_ttft_s=1e-9)
    assert ctx.policies["marginal-cost"].reject_bound(asked).reject_fraction == 0.0


def test_marginal_refuses_an_infeasible_request_once_calibrated() -> None:
    ctx = build_context(decode_config(_MARGINAL), None, None)
    ctx.policies["marginal-cost"].calibration.calibrate = False  # nominal constants: trusted
    state = _state(ctx, slo_ttft_s=1e-9)
    strategy, decision = _decide(ctx, state, "marginal-cost")
    assert decision.reason == REASON_SLO_INFEASIBLE and state.unenforced is None
    assert ctx.policies["marginal-cost"].reject_bound(state.route).reject_fraction == 1.0
    reply = strategy.record(state, decision)
    assert reply is not None and reply.status == 429
    assert msgspec.json.decode(reply.body)["error"]["code"] == "slo_infeasible"
    assert state.record.error is not None
    assert state.record.error.startswith(f"{REASON_SLO_INFEASIBLE}: ")


def test_marginal_tracks_each_attempt_in_the_fleets_engine_load() -> None:
    ctx = build_context(decode_config(_MARGINAL), None, None)
    strategy = build_strategies(ctx)["marginal-cost"]
    load = ctx.fleet.load
    assert load is not None
    route = MarginalRequest(key_hash=1, row=0, prompt_tokens=100, prefix=b"")
    tracked = strategy.admit(1, route, 10.0, None)
    assert tracked is not None and tracked.load is load and not tracked.decode_stage
    assert load.state.column("queued_requests").tolist() == [0.0, 1.0, 0.0, 0.0]
    strategy.release(tracked, False, 11.0)
    assert load.state.column("queued_requests").tolist() == [0.0] * 4
    assert strategy.admit(0, route, 12.0, "decode").decode_stage


def test_pair_strategies_wrap_each_pools_strategy_and_its_selector() -> None:
    plain = build_context(decode_config(_ENGINES), None, None)
    pair = build_pair_strategies(plain)[plain.config.policy.default]
    assert type(pair) is PairStrategy and plain.pd is not None
    assert pair.prefill.fleet is plain.pd.prefill and pair.decode.fleet is plain.pd.decode
    assert pair.selector is plain.pd.selector(plain.config.policy.default)
    marginal = build_context(decode_config(_MARGINAL), None, None)
    pair = build_pair_strategies(marginal)["marginal-cost"]
    assert isinstance(pair, MarginalPairStrategy) and isinstance(pair.selector, MarginalPairs)
    assert marginal.pd is not None and pair.p_load is marginal.pd.prefill.load
    assert build_pair_strategies(build_context(decode_config(_COLOCATED), None, None)) == {}
