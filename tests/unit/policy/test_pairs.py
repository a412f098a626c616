"""The P/D pair interface: independent rankings per pool, each from its own policy."""

from __future__ import annotations

from fastroute.policy import IndependentPairs, RouteRequest, make_policy


def test_independent_pairs_rank_each_pool_with_its_own_policy_and_row(make_view):
    """The prefill ranking is the prefill policy's choice over the prefill view with the
    prefill request, the decode ranking the decode policy's over the decode view."""
    prefill, decode = make_view(6, seed=1), make_view(8, seed=2)
    p_req = RouteRequest(key_hash=0x1234, row=0, prompt_tokens=100)
    d_req = RouteRequest(key_hash=0x1234, row=2, prompt_tokens=100)
    pairs = IndependentPairs(make_policy("weighted-hrw"), make_policy("weighted-hrw"))
    p_dec, d_dec = pairs.choose_pair(p_req, d_req, prefill, decode, 3)
    alone = make_policy("weighted-hrw")
    assert p_dec.ranked == alone.choose(p_req, prefill, k=3).ranked
    assert d_dec.ranked == alone.choose(d_req, decode, k=3).ranked
    assert len(p_dec.ranked) == len(d_dec.ranked) == 3
    assert d_dec.ranked != alone.choose(p_req, decode, k=3).ranked  # the decode row counts
