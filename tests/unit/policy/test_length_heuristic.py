"""length-heuristic: long prompts by token load, short ones by in-flight count."""

from __future__ import annotations

import numpy as np
import pytest

from fastroute.hashing import engine_id
from fastroute.policy import PolicyConfigError, RouteRequest, StaticFleetView, make_policy
from fastroute.policy.marginal import StaticEngineStateView


def state_view() -> StaticEngineStateView:
    """Three engines: 0 has few requests but much queued work, 1 many small ones, 2 mid."""
    view = StaticEngineStateView([engine_id(f"e{i}") for i in range(3)], np.ones((1, 3)))
    view.loads[:] = [1, 6, 3]
    st = view.state
    st.column("queued_prefill_tokens")[:] = [9000, 100, 800]
    st.column("running_context_tokens")[:] = [0, 600, 1500]
    return view


def test_long_prompt_goes_to_least_token_load_short_to_least_request():
    """A long prompt avoids engine 0's queued work; a short one takes its free slot."""
    policy = make_policy("length-heuristic", long_prompt_tokens=1000)
    view = state_view()
    long = policy.choose(RouteRequest(key_hash=1, row=0, prompt_tokens=4000), view, k=3)
    assert long.ranked == (1, 2, 0) and long.reason == "long-prompt"
    assert long.scores == (700.0, 2300.0, 9000.0)
    short = policy.choose(RouteRequest(key_hash=1, row=0, prompt_tokens=200), view, k=3)
    assert short.ranked == (0, 2, 1) and short.reason == "short-prompt"


def test_without_engine_state_it_uses_token_loads_then_counts():
    """A plain FleetView: in-flight tokens decide long prompts; none known: counts."""
    policy = make_policy("length-heuristic")
    view = StaticFleetView([engine_id(f"e{i}") for i in range(3)], np.ones((1, 3)))
    view.loads[:] = [0, 2, 1]
    view.token_loads[:] = [5000, 300, 900]
    req = RouteRequest(key_hash=7, row=0, prompt_tokens=2048)
    assert policy.choose(req, view, k=1).ranked == (1,)
    view.token_loads = None
    assert policy.choose(req, view, k=1).ranked == (0,)


def test_ties_follow_rendezvous_and_ineligible_engines_are_skipped():
    """Equal loads: the key's rendezvous order (sticky); zero weight: never chosen."""
    policy = make_policy("length-heuristic")
    view = StaticEngineStateView([engine_id(f"e{i}") for i in range(4)], np.array([[1, 1, 1, 0]]))
    picks = {policy.choose(RouteRequest(key_hash=k, row=0, prompt_tokens=50), view).ranked[0]
             for k in range(200)}  # fmt: skip
    assert picks == {0, 1, 2}
    first = policy.choose(RouteRequest(key_hash=42, row=0, prompt_tokens=5000), view, k=4)
    assert first == policy.choose(RouteRequest(key_hash=42, row=0, prompt_tokens=5000), view, k=4)
    assert 3 not in first.ranked


def test_bad_threshold_is_rejected():
    with pytest.raises(PolicyConfigError, match="long_prompt_tokens must be an int >= 1"):
        make_policy("length-heuristic", long_prompt_tokens=0)
