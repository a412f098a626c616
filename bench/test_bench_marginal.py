"""marginal-cost policy evaluation per request (goal: <= 20 µs for k = 3, docs/design.md §1B).

A round is CALLS_PER_ROUND decisions with distinct routing keys over a 16-engine class
row with live-looking engine state; divide by CALLS_PER_ROUND (recorded in
``extra_info`` as µs per call). Variants: without a prompt prefix, with a 4 KiB prefix
matched against a populated prefix tree, and a P/D pair choice (2 prefill x 4 decode
engines, k = 3 candidates per pool: 9 pairs).
"""

from __future__ import annotations

import numpy as np
import pytest

from fastroute.hashing import engine_id
from fastroute.policy import RouteRequest
from fastroute.policy.marginal import MarginalCost, StaticEngineStateView

CALLS_PER_ROUND = 1000


def _per_call(benchmark, run) -> None:
    benchmark(run)
    if benchmark.stats is not None:  # None under --benchmark-disable
        stats = benchmark.stats.stats
        benchmark.extra_info["median_us_per_call"] = round(1e6 * stats.median / CALLS_PER_ROUND, 2)
        benchmark.extra_info["min_us_per_call"] = round(1e6 * stats.min / CALLS_PER_ROUND, 2)


def _view(n: int, prefix: str, seed: int) -> StaticEngineStateView:
    rng = np.random.default_rng(seed)
    view = StaticEngineStateView([engine_id(f"{prefix}{i}") for i in range(n)], np.ones((1, n)))
    st = view.state
    batch = rng.integers(0, 64, n).astype(float)
    st.column("running_seqs")[:] = batch
    st.column("running_context_tokens")[:] = batch * rng.integers(500, 3000, n)
    st.column("running_remaining_tokens")[:] = batch * 150
    st.column("queued_prefill_tokens")[:] = rng.integers(0, 8000, n)
    st.column("queued_requests")[:] = rng.integers(0, 4, n)
    st.column("kv_capacity_tokens")[:] = 200_000
    st.column("kv_used_tokens")[:] = st.column("running_context_tokens")
    st.column("arrival_rate_rps")[:] = 2.0
    st.column("network_s")[:] = 0.0005
    return view


def _requests(prefix_bytes: int) -> list[RouteRequest]:
    rng = np.random.default_rng(7)
    stems = [rng.bytes(prefix_bytes) for _ in range(8)]
    return [
        RouteRequest(
            key_hash=int(rng.integers(0, 2**63)),
            row=0,
            prompt_tokens=int(rng.integers(100, 4000)),
            prefix=stems[i % 8] if prefix_bytes else b"",
            expected_output_tokens=int(rng.integers(20, 500)),
        )
        for i in range(CALLS_PER_ROUND)
    ]


@pytest.mark.benchmark(group="marginal")
@pytest.mark.parametrize("prefix_bytes", [0, 4096])
def test_choose_k3(benchmark, prefix_bytes) -> None:
    """choose() with k = 3 candidates over 16 engines; a round is 1000 decisions."""
    policy = MarginalCost(candidates=3, seed=1, slo_ttft_s=5.0, slo_tpot_s=0.2)
    view = _view(16, "e", 1)
    reqs = _requests(prefix_bytes)
    for i, req in enumerate(reqs[:64]):  # populate the prefix tree
        policy.on_routed(req, int(view.selector.engine_ids[i % 16]))
    choose = policy.choose

    def run() -> None:
        for req in reqs:
            choose(req, view, 3)

    _per_call(benchmark, run)
    d = choose(reqs[0], view, 3)
    assert len(d.ranked) == 3 and d.scores is not None


@pytest.mark.benchmark(group="marginal")
def test_choose_pair_k3(benchmark) -> None:
    """choose_pair() over 2 prefill x 4 decode engines (9 pairs); a round is 1000 decisions."""
    policy = MarginalCost(candidates=3, seed=1)
    prefill, decode = _view(2, "p", 2), _view(4, "d", 3)
    reqs = _requests(0)
    choose_pair = policy.choose_pair

    def run() -> None:
        for req in reqs:
            choose_pair(req, prefill, decode)

    _per_call(benchmark, run)
    assert choose_pair(reqs[0], prefill, decode).chosen is not None


@pytest.mark.benchmark(group="marginal")
def test_weighted_hrw_reference(benchmark) -> None:
    """weighted-hrw choose() on the same view and requests: the side-by-side reference, so the
    marginal-cost figures can be read as a ratio on a noisy machine."""
    from fastroute.policy import make_policy

    policy = make_policy("weighted-hrw")
    view = _view(16, "e", 1)
    reqs = _requests(0)
    choose = policy.choose

    def run() -> None:
        for req in reqs:
            choose(req, view, 3)

    _per_call(benchmark, run)
    assert len(choose(reqs[0], view, 3).ranked) == 3
