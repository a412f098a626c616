"""marginal-cost early rejection checked against realised outcomes: probes, the
attainment bound, and recovery from a model that predicts every request infeasible."""

from __future__ import annotations

import numpy as np
import pytest

from fastroute.hashing import engine_id
from fastroute.policy import PolicyConfigError, make_policy
from fastroute.policy.marginal import (
    REASON_SLO_INFEASIBLE,
    REASON_SLO_PROBE,
    MarginalRequest,
    StaticEngineStateView,
)

#: Decisions of the runs below.
RUN = 200


def idle(n: int) -> StaticEngineStateView:
    """``n`` idle A40 engines."""
    return StaticEngineStateView([engine_id(f"i{i}") for i in range(n)], np.ones((1, n)))


def request(i: int) -> MarginalRequest:
    """Predicted to miss a 1 ms TTFT on any engine (a pessimistic model's view)."""
    return MarginalRequest(key_hash=i, row=0, prompt_tokens=1500, expected_output_tokens=20)


def test_a_pessimistic_model_does_not_lock_the_policy_out():
    """Every request is predicted infeasible. Before any outcome only probes (every 20th)
    are routed; once the probes' outcomes say they met the SLO, the policy admits
    nearly everything; when outcomes say they miss again, it rejects again."""
    policy = make_policy("marginal-cost", slo_ttft_s=0.001, seed=1)
    view = idle(3)
    reasons = [policy.choose(request(i), view, k=2).reason for i in range(40)]
    assert reasons.count(REASON_SLO_PROBE) == 2 and reasons[19] == REASON_SLO_PROBE
    assert reasons.count(REASON_SLO_INFEASIBLE) == 38
    probe = policy.choose(request(40), view, k=2)  # not a probe: rejected
    assert probe.reason == REASON_SLO_INFEASIBLE and not probe.ranked
    for _ in range(2):  # the two probes met the SLO after all (the model was wrong)
        policy.observe_outcome(request(0), ttft_s=0.0005, tpot_s=0.01)
    rejected = 0
    for i in range(RUN):
        d = policy.choose(request(i), view, k=2)
        if d.reason == REASON_SLO_INFEASIBLE:
            rejected += 1
        else:
            assert d.ranked  # routed, by least cost (idle engines: no sink)
            policy.observe_outcome(request(i), ttft_s=0.0005, tpot_s=0.01)
    assert policy.reject_bound(request(0)).reject_fraction < 0.05 and rejected < 0.3 * RUN
    for i in range(RUN):  # now the admitted requests miss: rejection is justified
        d = policy.choose(request(i), view, k=2)
        if d.reason != REASON_SLO_INFEASIBLE:
            policy.observe_outcome(request(i), ttft_s=0.5, tpot_s=0.01)
    assert policy.reject_bound(request(0)).reject_fraction > 0.5


def test_a_pair_decision_is_bounded_too():
    policy = make_policy("marginal-cost", slo_ttft_s=0.001, seed=1)
    prefill, decode = idle(2), idle(2)
    pairs = [policy.choose_pair(request(i), prefill, decode, k=2) for i in range(20)]
    assert [p.chosen is None for p in pairs].count(False) == 1  # the 20th: a probe
    assert pairs[19].reason == REASON_SLO_PROBE
    policy.observe_outcome(request(0), ttft_s=0.0005, tpot_s=None)
    admitted = [policy.choose_pair(request(i), prefill, decode, k=2) for i in range(RUN)]
    assert sum(p.chosen is not None for p in admitted) > 0.5 * RUN


def test_outcomes_of_requests_without_an_slo_are_not_counted():
    policy = make_policy("marginal-cost", seed=1)
    policy.observe_outcome(request(0), ttft_s=9.0, tpot_s=9.0)
    assert policy.reject_bound(request(0)).outcomes == 0
    per_request = MarginalRequest(key_hash=1, row=0, prompt_tokens=10, slo_tpot_s=0.05)
    policy.observe_outcome(per_request, ttft_s=9.0, tpot_s=0.01)  # TTFT has no SLO: met
    policy.observe_outcome(per_request, ttft_s=None, tpot_s=0.06)
    assert policy.reject_bound(request(0)).outcomes == 0
    bound = policy.reject_bound(per_request)
    assert bound.outcomes == 2 and bound.miss_fraction == pytest.approx(2 / 4)


@pytest.mark.parametrize("params", [{"probe_rate": 0.0}, {"reject_window": 0}])
def test_bad_bound_tunables(params):
    with pytest.raises(PolicyConfigError, match="probe_rate|window"):
        make_policy("marginal-cost", **params)


def test_each_slo_has_its_own_bound():
    """Outcomes against a 2 s TTFT say nothing about a 1 ms one: the healthy class's hits
    do not stop the impossible objective's rejection."""
    policy = make_policy("marginal-cost", seed=1)
    view = idle(3)
    easy = MarginalRequest(key_hash=1, row=0, prompt_tokens=100, slo_ttft_s=2.0)
    impossible = MarginalRequest(key_hash=2, row=0, prompt_tokens=1500, slo_ttft_s=0.001)
    for _ in range(50):
        assert policy.choose(easy, view, k=2).ranked
        policy.observe_outcome(easy, ttft_s=0.1, tpot_s=0.01)
    assert policy.choose(impossible, view, k=2).reason == REASON_SLO_INFEASIBLE
    assert policy.reject_bound(impossible).reject_fraction == 1.0
    assert policy.reject_bound(easy).outcomes == 50
