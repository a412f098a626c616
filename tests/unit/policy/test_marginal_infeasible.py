"""marginal-cost ``infeasible="deprioritise"``: a request predicted to miss its SLO
everywhere is routed behind the longest predicted wait instead of rejected."""

from __future__ import annotations

import numpy as np
import pytest

from fastroute.hashing import engine_id
from fastroute.policy import PolicyConfigError, make_policy
from fastroute.policy.marginal import (
    REASON_SLO_DEPRIORITISED,
    REASON_SLO_INFEASIBLE,
    MarginalRequest,
    StaticEngineStateView,
)


def queued(tokens: list[float]) -> StaticEngineStateView:
    """A40 engines with ``tokens`` prompt tokens queued each, nothing running."""
    n = len(tokens)
    view = StaticEngineStateView([engine_id(f"q{i}") for i in range(n)], np.ones((1, n)))
    view.state.column("queued_prefill_tokens")[:] = tokens
    view.state.column("queued_requests")[:] = [t // 1000 for t in tokens]
    return view


def test_doomed_request_goes_behind_the_longest_queue():
    """All three candidates miss a 50 ms TTFT: reject by default; deprioritise picks the
    longest predicted wait. A feasible request still takes the cheapest engine."""
    view = queued([4000.0, 12000.0, 8000.0])
    req = MarginalRequest(key_hash=5, row=0, prompt_tokens=1500, expected_output_tokens=50)
    strict = make_policy("marginal-cost", slo_ttft_s=0.05, seed=1)
    assert strict.choose(req, view, k=3).reason == REASON_SLO_INFEASIBLE
    soft = make_policy("marginal-cost", slo_ttft_s=0.05, infeasible="deprioritise", seed=1)
    d = soft.choose(req, view, k=3)
    assert d.reason == REASON_SLO_DEPRIORITISED and d.ranked[0] == 1
    loose = make_policy("marginal-cost", slo_ttft_s=30.0, infeasible="deprioritise", seed=1)
    assert loose.choose(req, view, k=3).ranked[0] == 0


def test_doomed_pair_takes_the_longest_prefill_queue():
    """P/D: no pair meets the SLO -> the prefill engine with the longest wait, not a 429."""
    prefill = queued([2000.0, 9000.0])
    decode = queued([0.0, 0.0, 0.0])
    req = MarginalRequest(key_hash=9, row=0, prompt_tokens=1200, expected_output_tokens=40)
    soft = make_policy("marginal-cost", slo_ttft_s=0.02, infeasible="deprioritise", seed=1)
    pair = soft.choose_pair(req, prefill, decode, k=2)
    assert pair.reason == REASON_SLO_DEPRIORITISED and pair.chosen[0] == 1
    strict = make_policy("marginal-cost", slo_ttft_s=0.02, seed=1)
    assert strict.choose_pair(req, prefill, decode, k=2).chosen is None


def test_bad_infeasible_option_is_rejected():
    with pytest.raises(PolicyConfigError, match="infeasible must be 'reject' or 'deprioritise'"):
        make_policy("marginal-cost", infeasible="drop")


def test_no_idle_engine_becomes_a_sink():
    """A request too big for its SLO on idle engines is routed by least cost (work
    conserving), not piled behind one engine: the queue-free engine takes it."""
    view = queued([0.0, 0.0, 500.0])
    req = MarginalRequest(key_hash=3, row=0, prompt_tokens=6000, expected_output_tokens=10)
    soft = make_policy("marginal-cost", slo_ttft_s=0.3, infeasible="deprioritise", seed=1)
    d = soft.choose(req, view, k=3)
    assert d.reason == "slo-miss-least-cost" and d.ranked[0] in (0, 1)
