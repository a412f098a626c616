"""The marginal-cost policy: idle vs busy, cached prefixes, SLOs, KV, scarcity guard, P/D pairs."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from fastroute.hardware import get_profile
from fastroute.hashing import engine_id
from fastroute.policy import PolicyConfigError, RouteRequest, StaticFleetView, make_policy
from fastroute.policy.marginal import (
    COLUMNS,
    REASON_SLO_INFEASIBLE,
    EngineState,
    EngineStateView,
    MarginalCost,
    MarginalDecision,
    MarginalPairs,
    MarginalRequest,
    StateColumn,
    StaticEngineStateView,
)

A40 = get_profile("a40")


def fleet(n: int = 4, *, batch: float = 0.0, ctx_per_seq: float = 2000.0) -> StaticEngineStateView:
    """n equal-weight A40 engines, each running ``batch`` sequences, 200 k tokens of KV."""
    view = StaticEngineStateView([engine_id(f"m{i}") for i in range(n)], np.ones((1, n)))
    st = view.state
    st.column("running_seqs")[:] = batch
    st.column("running_context_tokens")[:] = batch * ctx_per_seq
    st.column("kv_capacity_tokens")[:] = 200_000
    st.column("kv_used_tokens")[:] = batch * ctx_per_seq
    return view


def set_busy(view: StaticEngineStateView, e: int, batch: float, queued: float = 0.0) -> None:
    st = view.state
    st.column("running_seqs")[e] = batch
    st.column("running_context_tokens")[e] = batch * 2000
    st.column("kv_used_tokens")[e] = batch * 2000
    st.column("queued_prefill_tokens")[e] = queued
    st.column("queued_requests")[e] = queued // 2000


def test_view_satisfies_the_protocol():
    assert isinstance(fleet(), EngineStateView)
    assert not isinstance(StaticFleetView([1, 2], np.ones((1, 2))), EngineStateView)


def test_prefers_the_idle_engine_for_a_long_request(rand):
    """Among the key's three rendezvous candidates, the idle one wins even when it is last
    in rendezvous order; weighted-hrw would have sent it to a busy one."""
    policy = MarginalCost(seed=1)
    for _ in range(30):
        view = fleet(6, batch=48)
        key = rand.getrandbits(64)
        top3 = view.selector.rank(key, 0, 3)
        idle = top3[rand.randrange(1, 3)]
        set_busy(view, idle, 0)
        req = RouteRequest(key_hash=key, row=0, prompt_tokens=6000, expected_output_tokens=400)
        d = policy.choose(req, view)
        assert d.chosen == idle and d.reason == "marginal"
        assert set(d.ranked) == set(top3)  # only the top-k candidates are considered
        assert d.scores[0] == min(d.scores)
        assert make_policy("weighted-hrw").choose(req, view).chosen != idle


def test_prefers_the_engine_holding_a_long_shared_prefix(rand):
    """Equal loads: the candidate whose tree holds the prompt's prefix prefills only the
    rest and is chosen; the cached tokens show in the decision."""
    policy = MarginalCost(seed=1)
    view = fleet(4, batch=8)
    text = bytes(rand.getrandbits(8) for _ in range(12_000))  # whole prompt, ~3000 tokens
    key = rand.getrandbits(64)
    holder = view.selector.rank(key, 0, 3)[2]
    first = RouteRequest(key_hash=1, row=0, prompt_tokens=3000, prefix=text)
    policy.on_routed(first, view.selector.engine_ids[holder])
    follow_up = RouteRequest(key_hash=key, row=0, prompt_tokens=3100, prefix=text + b"more")
    d = policy.choose(follow_up, view)
    assert d.chosen == holder and isinstance(d, MarginalDecision)
    assert d.cached_tokens == pytest.approx(3100 * len(text) / len(follow_up.prefix), abs=2)
    # ... but not at any price: a long queue on the holder sends it elsewhere.
    set_busy(view, holder, 8, queued=60_000)
    assert policy.choose(follow_up, view).chosen != holder


def test_engine_reported_prefix_hits_take_precedence_over_the_tree(rand):
    """A view that knows the engines' caches (the simulator) overrides the routing history."""
    policy = MarginalCost(seed=1)
    view = fleet(4, batch=8)
    key = rand.getrandbits(64)
    top3 = view.selector.rank(key, 0, 3)
    view.prefix_hits = np.zeros(4)
    view.prefix_hits[top3[1]] = 2500
    d = policy.choose(RouteRequest(key_hash=key, row=0, prompt_tokens=3000), view)
    assert d.chosen == top3[1] and d.cached_tokens == 2500


def test_slo_infeasible_everywhere_gives_a_reasoned_rejection():
    """A 4000-token prompt cannot start within 50 ms on an A40: empty ranking, reason
    'slo-infeasible', predictions in the detail; a looser per-request SLO is admitted."""
    policy = MarginalCost(slo_ttft_s=0.05, seed=1)
    view = fleet(4, batch=4)
    req = MarginalRequest(key_hash=7, row=0, prompt_tokens=4000, expected_output_tokens=100)
    d = policy.choose(req, view)
    assert d.ranked == () and d.chosen is None
    assert d.reason == REASON_SLO_INFEASIBLE
    assert "TTFT" in d.detail and "0.050 s" in d.detail
    assert d.ttft_s > 0.05
    relaxed = MarginalRequest(
        key_hash=7, row=0, prompt_tokens=4000, expected_output_tokens=100, slo_ttft_s=5.0
    )
    assert policy.choose(relaxed, view).reason == "marginal"


def test_tpot_slo_and_spill_beyond_the_candidates():
    """Top-1 only (candidates=1) is overloaded: the policy spills to a feasible engine
    outside the candidates rather than rejecting."""
    policy = MarginalCost(candidates=1, slo_tpot_s=0.06, seed=1)
    view = fleet(4, batch=4)
    key = 99
    top = view.selector.rank(key, 0, 1)[0]
    set_busy(view, top, 200)  # b1·200 + b2·400k tokens per step: far over 60 ms
    d = policy.choose(RouteRequest(key_hash=key, row=0, prompt_tokens=500), view)
    assert d.reason == "slo-spill" and d.chosen != top
    assert d.tpot_s <= 0.06


def test_kv_pressure_makes_an_engine_infeasible():
    """An engine whose KV cache cannot take the request is avoided; if all are full and no
    SLO is set, the least-cost one is still chosen (reason 'kv-full')."""
    policy = MarginalCost(candidates=4, seed=1)
    view = fleet(4, batch=0)
    kv = view.state.column("kv_used_tokens")
    kv[:] = 199_000
    kv[2] = 0
    req = RouteRequest(key_hash=5, row=0, prompt_tokens=2000, expected_output_tokens=500)
    assert policy.choose(req, view).chosen == 2
    kv[2] = 199_000
    assert policy.choose(req, view).reason == "kv-full"


def test_near_tie_guard_spreads_load_that_argmin_would_concentrate():
    """Identical idle engines: greedy argmin sends every request of a key to one engine; the
    power-of-two guard spreads them and follows live in-flight counts."""
    req = RouteRequest(key_hash=42, row=0, prompt_tokens=1000, expected_output_tokens=200)
    greedy = MarginalCost(candidates=4, near_tie=0.0, seed=1)
    view = fleet(4)
    assert len({greedy.choose(req, view).chosen for _ in range(100)}) == 1
    guarded = MarginalCost(candidates=4, near_tie=0.05, seed=1)
    view = fleet(4)
    for _ in range(200):
        d = guarded.choose(req, view)
        view.loads[d.chosen] += 1  # what the proxy's in-flight counters do
    assert view.loads.min() >= 35 and view.loads.max() <= 65
    assert guarded.choose(req, view).reason in ("marginal", "near-tie-p2c")


def test_calibration_changes_the_decision_and_uncalibrated_ignores_timings():
    """Engines really are 2x slower than the A40 constants: the calibrated policy learns it
    and rejects a request it would miss; the uncalibrated one keeps admitting it."""
    slo = 2.0 * A40.prefill_time_s(1500) * 0.8  # between nominal and true TTFT
    calibrated = MarginalCost(slo_ttft_s=slo, seed=1)
    nominal = MarginalCost(slo_ttft_s=slo, calibrate=False, seed=1)
    view = fleet(3)
    for policy in (calibrated, nominal):
        for tokens in range(100, 2000, 10):  # single-chunk prefills (budget 2048)
            for e in view.selector.engine_ids:
                policy.calibration.observe_prefill(
                    "a40", int(e), tokens, 0, 2.0 * A40.prefill_time_s(tokens)
                )
    req = RouteRequest(key_hash=3, row=0, prompt_tokens=1500, expected_output_tokens=10)
    d_cal = calibrated.choose(req, view)
    assert d_cal.reason == REASON_SLO_INFEASIBLE
    assert d_cal.ttft_s == pytest.approx(2.0 * A40.prefill_time_s(1500), rel=0.03)
    d_nom = nominal.choose(req, view)
    assert d_nom.chosen is not None
    assert d_nom.ttft_s == pytest.approx(A40.prefill_time_s(1500), rel=1e-9)
    state = calibrated.calibration_state()["types"]["a40"]
    assert state["n_samples"] > 0 and state["coef"]["a1_s"] > 1.5 * A40.a1_s


def test_output_length_comes_from_the_predictor_when_not_given():
    """Without expected_output_tokens the class's predicted mean output length is used."""
    policy = MarginalCost(seed=1)
    req = RouteRequest(key_hash=3, row=0, prompt_tokens=100)
    for _ in range(60):
        policy.observe_output(req, 900, now_s=0.0)
    assert policy.choose(req, fleet()).output_tokens == pytest.approx(900)


def test_plain_fleet_view_falls_back_to_in_flight_counts():
    """On a view without engine state the in-flight requests stand in for the batch."""
    view = StaticFleetView([engine_id(f"m{i}") for i in range(4)], np.ones((1, 4)))
    view.loads[:] = [30, 30, 0, 30]
    d = MarginalCost(candidates=4, seed=1).choose(
        RouteRequest(key_hash=1, row=0, prompt_tokens=2000, expected_output_tokens=300), view
    )
    assert d.chosen == 2


def test_decision_encodes_for_the_decision_record():
    """The decision (with its predictions) round-trips through JSON."""
    d = MarginalCost(seed=1).choose(
        RouteRequest(key_hash=11, row=0, prompt_tokens=500, expected_output_tokens=50), fleet()
    )
    back = msgspec.json.decode(msgspec.json.encode(d), type=MarginalDecision)
    assert back == d and back.ttft_s > 0 and back.tpot_s > 0


def pools() -> tuple[StaticEngineStateView, StaticEngineStateView]:
    prefill = fleet(2)
    decode = StaticEngineStateView([engine_id(f"d{i}") for i in range(3)], np.ones((1, 3)))
    decode.state.column("kv_capacity_tokens")[:] = 200_000
    for d, batch in enumerate((100, 5, 50)):
        decode.state.column("running_seqs")[d] = batch
        decode.state.column("running_context_tokens")[d] = batch * 1500
    return prefill, decode


def test_pair_selection_picks_the_free_prefill_and_the_light_decode_engine():
    """P/D: the prefill engine without a queue and the decode engine with the smallest
    batch; the client TTFT includes the KV transfer and the first decode step."""
    policy = MarginalCost(seed=1, near_tie=0.0)
    prefill, decode = pools()
    prefill.state.column("queued_prefill_tokens")[0] = 30_000
    prefill.state.column("queued_requests")[0] = 15
    req = RouteRequest(key_hash=8, row=0, prompt_tokens=2000, expected_output_tokens=300)
    pair = policy.choose_pair(req, prefill, decode)
    assert pair.chosen == (1, 1) and pair.reason == "marginal"
    assert pair.transfer_s == pytest.approx(policy.calibration.transfer.predict_s(1999))
    assert pair.ttft_s > A40.prefill_time_s(2000) + pair.transfer_s
    assert pair.prefill.engine_ids[0] == int(prefill.selector.engine_ids[1])
    assert len(pair.decode.ranked) == 3 and len(set(pair.decode.ranked)) == 3


def test_pair_rejected_when_no_pair_meets_the_slo_and_empty_pools():
    policy = MarginalCost(seed=1, slo_tpot_s=0.001)
    prefill, decode = pools()
    req = RouteRequest(key_hash=8, row=0, prompt_tokens=2000, expected_output_tokens=300)
    pair = policy.choose_pair(req, prefill, decode)
    assert pair.reason == REASON_SLO_INFEASIBLE and pair.chosen is None and "TPOT" in pair.detail
    prefill.set_available([False, False])
    assert policy.choose_pair(req, prefill, decode).reason == "no-eligible-engine"


def test_pair_selector_adapter_for_the_proxy():
    """MarginalPairs has the proxy's PairSelector shape: per-pool requests in, two
    decisions out; a rejection carries the reason and detail on the prefill decision."""
    prefill, decode = pools()
    req = RouteRequest(key_hash=8, row=0, prompt_tokens=2000, expected_output_tokens=300)
    p_dec, d_dec = MarginalPairs(MarginalCost(seed=1)).choose_pair(req, req, prefill, decode, 2)
    assert len(p_dec.ranked) == 2 and len(d_dec.ranked) == 2
    strict = MarginalPairs(MarginalCost(seed=1, slo_ttft_s=0.01))
    p_dec, d_dec = strict.choose_pair(req, req, prefill, decode, 2)
    assert p_dec.ranked == () and d_dec.ranked == ()
    assert p_dec.reason == REASON_SLO_INFEASIBLE and "TTFT" in p_dec.detail
    assert strict.last is not None and strict.last.reason == REASON_SLO_INFEASIBLE


def test_pools_of_different_types_use_their_own_models():
    """A fast (h100) prefill pool beside an a40 decode pool: each side uses its type."""
    policy = MarginalCost(seed=1)
    prefill = StaticEngineStateView(
        [engine_id("h0"), engine_id("h1")], np.ones((1, 2)), type_names=("h100",)
    )
    _, decode = pools()
    req = RouteRequest(key_hash=8, row=0, prompt_tokens=2000, expected_output_tokens=300)
    pair = policy.choose_pair(req, prefill, decode)
    h100 = get_profile("h100")
    assert pair.prefill.ttft_s == pytest.approx(h100.prefill_time_s(2000), rel=1e-9)
    assert pair.prefill.ttft_s < 0.5 * A40.prefill_time_s(2000)


@pytest.mark.parametrize(
    "params",
    [
        {"candidates": 0},
        {"slo_ttft_s": 0.0},
        {"near_tie": -0.1},
        {"bytes_per_token": 0},
        {"engine_type": "tpu-v9"},
    ],
)
def test_invalid_tunables_are_rejected(params):
    with pytest.raises(PolicyConfigError, match="marginal-cost"):
        make_policy("marginal-cost", **params)


def test_prefill_interleaved_with_decodes_costs_tpot_and_is_an_externality(rand):
    """Co-located engines: the prefill tokens expected beside each decode step raise the
    predicted TPOT by m1 per token (a TPOT SLO then steers away from the engine that
    prefills the most), and a long prompt routed beside running decodes costs them
    m1 per uncached token each."""
    policy = MarginalCost(slo_tpot_s=0.05, seed=1)
    m1 = policy.calibration.model("a40").rls.coef[7]
    view = fleet(3, batch=8)
    key = rand.getrandbits(64)
    top3 = view.selector.rank(key, 0, 3)
    mix = view.state.column("prefill_tokens_per_step")
    mix[:] = 400.0
    quiet = top3[2]
    mix[quiet] = 0.0
    req = RouteRequest(key_hash=key, row=0, prompt_tokens=200, expected_output_tokens=100)
    d = policy.choose(req, view)
    assert d.chosen == quiet
    noisy_tpot = policy._evaluate(top3[0], d.engine_ids[1], 200, 100.0, None, view.state,
                                  None, None, None).tpot  # fmt: skip
    assert noisy_tpot - d.tpot_s == pytest.approx(400.0 * m1, rel=1e-6)
    # The externality of a long prompt on the 8 running decodes: 8 · m1 · n.
    short = policy._evaluate(quiet, 1, 200, 100.0, None, view.state, None, None, None)
    long = policy._evaluate(quiet, 1, 1200, 100.0, None, view.state, None, None, None)
    b2 = policy.calibration.model("a40").rls.coef[3]
    overlap = 8 * min(100.0, policy.output_lengths.mean())  # B · min(N̂, E[N])
    assert long.ext - short.ext == pytest.approx(8 * m1 * 1000 + b2 * 1000 * overlap, rel=1e-6)


def test_state_columns_are_one_enum() -> None:
    """COLUMNS are the StateColumn members in order; a column reads the same by name or member."""
    assert COLUMNS == tuple(c.name.lower() for c in sorted(StateColumn))
    assert [int(c) for c in StateColumn] == list(range(len(COLUMNS)))
    st = EngineState(3)
    assert st.values.shape == (3, len(StateColumn))
    for c in StateColumn:
        st.column(c)[:] = int(c) + 1
        assert np.array_equal(st.column(c.name.lower()), st.values[:, c])
    assert st.values[0].tolist() == [float(c) + 1 for c in StateColumn]
    with pytest.raises(KeyError, match="unknown column"):
        st.column("no_such_column")
