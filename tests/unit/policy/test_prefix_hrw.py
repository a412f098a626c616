"""``prefix-hrw``: depth keys, homes, the token-load bound, hot prefixes, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from fastroute.hashing import engine_id
from fastroute.policy import PolicyConfigError, RouteRequest, StaticFleetView, make_policy
from fastroute.policy.prefix_hrw import PrefixHRW, depth_keys, private_key_log


def _view(n: int = 8, weights: list[float] | None = None) -> StaticFleetView:
    w = np.array([weights if weights is not None else [1.0] * n])
    return StaticFleetView([engine_id(f"e{i}") for i in range(n)], w)


def _text(seed: int, n_bytes: int) -> bytes:
    rng = np.random.default_rng(seed)
    return bytes(rng.integers(97, 123, size=n_bytes, dtype=np.uint8))


def _request(prefix: bytes, key: int = 1, tokens: int = 0) -> RouteRequest:
    return RouteRequest(key_hash=key, row=0, prompt_tokens=tokens, prefix=prefix)


def test_requests_sharing_s_bytes_share_exactly_the_depths_up_to_s() -> None:
    shared = _text(1, 3000)
    a, b = shared + _text(2, 5000), shared + _text(3, 5000)
    ka, kb = depth_keys(a, 512), depth_keys(b, 512)
    assert [d for d, _ in ka] == [512, 1024, 2048, 4096]
    common = [d for (d, x), (_, y) in zip(ka, kb, strict=True) if x == y]
    assert common == [512, 1024, 2048]  # 3000 shared bytes: depths <= 3000 only
    assert depth_keys(b"x" * 511, 512) == []


def _warmed(
    policy: PrefixHRW, view: StaticFleetView, tokens: int = 1000, requests: int = 0
) -> PrefixHRW:
    """``policy`` after ``requests`` (default 4 n) unrelated routed requests of ``tokens``:
    enough observations to tell a group's share (before 2 n it routes by the most specific
    key alone), and one more such request is not a hot group."""
    for s in range(requests or 4 * view.selector.n_engines):
        request = _request(_text(5000 + s, 600), tokens=tokens)
        policy.on_routed(request, policy.choose(request, view).engine_ids[0])
    return policy


def test_idle_requests_sharing_the_first_block_go_home_whatever_follows() -> None:
    view = _view()
    policy = _warmed(PrefixHRW(), view)
    head = _text(5, 600)
    chosen = {policy.choose(_request(head + _text(s, 4000)), view).chosen for s in range(50)}
    assert len(chosen) == 1
    decision = policy.choose(_request(head + _text(99, 100)), view)
    assert decision.reason == "prefix-home" and decision.scores[0] == 512.0


@pytest.mark.parametrize("system_bytes", [24_000, 1_500])
def test_a_cold_worker_spreads_requests_that_share_a_root(system_bytes: int) -> None:
    """Before 2 n observations no share can be told from noise: each request goes by its
    most specific key (the conversation's routing key, else the deepest depth), so a
    fresh worker does not send a prompt that everybody shares to one home (eight fresh
    workers with one 24 kB system prompt put 79 % of a fleet benchmark's requests on
    one of four engines)."""
    view = _view(8)
    policy = PrefixHRW()
    system = _text(8, system_bytes)
    chosen = []
    for s in range(16):
        prompt = system + _text(600 + s, 2600)
        # a chat request's routing key: the messages through the first user message
        key = (s + 1) * 7919 if system_bytes > 2000 else 1
        depth = len(prompt) if system_bytes > 2000 else -1
        request = RouteRequest(key_hash=key, key_depth_bytes=depth, row=0, prefix=prompt)
        decision = policy.choose(request, view)
        policy.on_routed(request, decision.engine_ids[0])
        chosen.append(decision.chosen)
        assert decision.scores[0] == len(prompt)  # the routing key, else the whole prompt
    assert len(set(chosen)) >= 4 and max(chosen.count(i) for i in chosen) <= 8  # not 16


def test_a_cold_worker_keeps_a_declared_session_together() -> None:
    """The routing key, when it is one of the keys (a session id at depth 0), decides in
    the cold start too: one session's turns stay on one engine."""
    view, policy = _view(8), PrefixHRW()
    system = _text(9, 24_000)
    chosen = set()
    for s in range(12):
        request = RouteRequest(
            key_hash=77, key_depth_bytes=0, row=0, prefix=system + _text(700 + s, 600)
        )
        decision = policy.choose(request, view)
        policy.on_routed(request, decision.engine_ids[0])
        chosen.add(decision.chosen)
        assert decision.scores[0] == 0.0
    assert len(chosen) == 1


def test_a_cold_worker_balances_queues_by_what_it_has_observed_only() -> None:
    """Cold, the deciding key (here the routing key, 8.6 kB deep) was not chosen for a
    cache: the cost spill's saving is the depth observed (nothing yet), so a request whose
    home has a queue goes to the least-loaded engine instead of waiting for a saving that
    nothing suggests."""
    view, policy = _queued_view(), PrefixHRW()
    prompt = _text(31, 8600)
    request = RouteRequest(key_hash=99, key_depth_bytes=len(prompt), row=0, prefix=prompt)
    home = policy.choose(request, view).chosen
    view.queued_loads[:] = 600
    view.queued_loads[(home + 1) % 4] = 0  # idle
    view.queued_loads[home] = 1000  # within the bound; under the 2150 tokens the
    decision = policy.choose(request, view)  # routing key's depth would have claimed
    assert (decision.reason, decision.chosen) == ("cost-spill", (home + 1) % 4)


def test_a_long_agent_session_is_not_a_hot_group() -> None:
    """A group's share counts requests: one agent session whose prompt grows from 9 kB to
    40 kB, one step among every 11 requests, is 9 % of the traffic, under an engine's
    hot threshold (12.5 % of 4 engines), so its steps stay on one engine with their cache.
    By prompt tokens it was 20-55 % of the weight, hot, and its steps followed its deepest
    key from home to home as the prompt grew."""
    view = _view(4)
    policy = _warmed(PrefixHRW(), view, requests=256)
    session = _text(41, 40_000)
    homes = set()
    for step in range(40):
        prompt = session[: 9000 + 800 * step]
        request = RouteRequest(
            key_hash=5, key_depth_bytes=9000, row=0, prompt_tokens=len(prompt) // 4, prefix=prompt
        )
        decision = policy.choose(request, view)
        policy.on_routed(request, decision.engine_ids[0])
        homes.add(decision.chosen)
        for other in range(10):
            r = _request(_text(10_000 + 10 * step + other, 600), tokens=1000)
            policy.on_routed(r, policy.choose(r, view).engine_ids[0])
    assert len(homes) == 1


def test_unrelated_prefixes_spread_by_weight() -> None:
    view, policy = _view(4, [3.0, 1.0, 1.0, 1.0]), PrefixHRW()
    counts = np.zeros(4)
    for s in range(3000):
        counts[policy.choose(_request(_text(s, 600)), view).chosen] += 1
    share = counts / counts.sum()
    assert abs(share[0] - 0.5) < 0.04 and np.all(np.abs(share[1:] - 1 / 6) < 0.04)


def test_a_hot_prefix_is_replicated_within_the_bound() -> None:
    """Everybody shares a 2 kB system prompt; requests stay in flight. No engine takes more
    than c x its share of the tokens (plus the request that crossed the line), and the
    hot prefix spreads over several engines."""
    view, policy = _view(8), PrefixHRW(balance_factor=1.25)
    system = _text(7, 2048)
    tokens = 1000
    for s in range(400):
        user = _text(1000 + s % 40, 2500)  # 40 conversations after the shared prompt
        decision = policy.choose(_request(system + user, tokens=tokens), view)
        i = decision.chosen
        loads = view.token_loads
        if loads.sum():
            assert loads[i] * 8 <= 1.25 * loads.sum() + 1e-9  # within bound before adding
        loads[i] += tokens
    share = view.token_loads / view.token_loads.sum()
    assert share.max() <= 1.25 / 8 + tokens / view.token_loads.sum()
    assert (view.token_loads > 0).sum() >= 6


def test_prompts_shorter_than_a_block_use_the_routing_key() -> None:
    view, policy = _view(), PrefixHRW()
    decision = policy.choose(_request(b"hi", key=12345), view)
    assert decision.reason == "no-prefix"
    assert decision.ranked == tuple(view.selector.rank(12345, 0, 3, view.eligible(0)))


def test_deep_order_goes_to_the_deepest_home_and_no_state_is_kept() -> None:
    view = _view()
    prefix = _text(3, 5000)
    deep = PrefixHRW(order="deep").choose(_request(prefix), view)
    assert deep.scores[0] == 5000.0  # no routing key among the keys: the whole prompt
    a, b = PrefixHRW(), PrefixHRW()  # two workers: same decision with no shared state
    assert a.choose(_request(prefix), view) == b.choose(_request(prefix), view)


def test_over_bound_home_spills_to_the_next_depth_then_to_the_least_loaded() -> None:
    view, policy = _view(4), PrefixHRW(balance_factor=1.0)
    prefix = _text(11, 1100)  # depths 512 and 1024, then the whole prompt (1100)
    keys = [h for _, h in policy.keys(_request(prefix))]
    assert len(keys) == 3
    homes = [view.selector.pick(h, 0) for h in keys]
    view.token_loads[:] = 10
    view.token_loads[homes[0]] = 100
    decision = policy.choose(_request(prefix), view)
    if homes[1] != homes[0]:
        assert (decision.chosen, decision.reason) == (homes[1], "prefix-spill")
    view.token_loads[homes] = 100
    decision = policy.choose(_request(prefix), view)
    assert decision.reason == "bounded-spill"
    assert view.token_loads[decision.chosen] == 10


def test_bad_tunables_are_rejected_with_the_reason() -> None:
    for params, message in [
        ({"block_bytes": 16}, "block_bytes"),
        ({"block_bytes": 1024, "prefix_bytes": 512}, "prefix_bytes"),
        ({"balance_factor": 0.5}, "balance_factor"),
        ({"order": "middle"}, "order"),
    ]:
        with pytest.raises(PolicyConfigError, match=message):
            make_policy("prefix-hrw", **params)
    assert make_policy("prefix-hrw", prefix_bytes=8192).prefix_bytes == 8192


def test_a_hot_group_spreads_by_its_sub_groups_which_stay_whole() -> None:
    """Once everybody's 2 kB system prompt is hot (share > 1/n), requests go to the homes
    of their conversations (the next depth), not to the system prompt's home: every
    conversation keeps one engine, and the conversations cover most engines."""
    view, policy = _view(8), PrefixHRW(hot_half_life_requests=200)
    system = _text(7, 2048)
    engines: dict[int, set[int]] = {}
    for s in range(600):
        conv = s % 60
        request = _request(system + _text(5000 + conv, 3000), tokens=100)
        decision = policy.choose(request, view)
        policy.on_routed(request, int(view.selector.engine_ids[decision.chosen]))
        if s >= 300:  # after the share estimate has seen the traffic
            engines.setdefault(conv, set()).add(decision.chosen)
            # the conversation's depth (or, once the conversation's whole prompt was sent
            # elsewhere, that prompt where it went: rule 3), not 512..2048
            assert decision.scores[0] >= 4096.0
    assert all(len(e) == 1 for e in engines.values())
    assert len(set().union(*engines.values())) >= 7


def _queued_view(n: int = 4) -> StaticFleetView:
    view = _view(n)
    view.queued_loads = np.zeros(n, dtype=np.int64)
    return view


def test_the_load_is_the_queued_prefill_when_the_view_tracks_it() -> None:
    """Decoding contexts (in-flight tokens) do not delay a new request's prefill; the
    prompts queued ahead of it do."""
    view, policy = _queued_view(), PrefixHRW(balance_factor=1.0)
    prefix = _text(21, 600)
    home = policy.choose(_request(prefix, tokens=150), view).chosen
    view.token_loads[:] = 10
    view.token_loads[home] = 10**6  # long decodes in flight, nothing queued
    assert policy.choose(_request(prefix, tokens=150), view).chosen == home
    view.queued_loads[:] = 10
    view.queued_loads[home] = 10**6
    assert policy.choose(_request(prefix, tokens=150), view).chosen != home


def test_the_other_proxies_queue_counts_like_the_own() -> None:
    """``peer_queued`` (what the other proxies queued, polled) adds to the own queue: a
    home another proxy has loaded is as loaded as one this proxy loaded."""
    view, policy = _queued_view(), PrefixHRW(balance_factor=1.0)
    prefix = _text(24, 600)
    home = policy.choose(_request(prefix, tokens=150), view).chosen
    view.queued_loads[:] = 10
    view.peer_queued = np.zeros(4, dtype=np.int64)
    view.peer_queued[home] = 10**6
    assert view.queued_tokens()[home] == 10**6 + 10
    assert view.queued_loads[home] == 10  # the own count is not changed
    assert policy.choose(_request(prefix, tokens=150), view).chosen != home
    view.peer_queued[home] = 0
    assert policy.choose(_request(prefix, tokens=150), view).chosen == home


def test_the_cost_spill_weighs_the_homes_extra_queue_against_the_cached_prefix() -> None:
    """The saving is the deepest depth of the request the seen table holds: after one
    request, all five of its keys (the deepest: the whole 4096-byte prompt, 1024 tokens),
    where the share table observed only three (through the deciding key's next depth).
    The request stays home while the home's extra queue is under that saving, and goes to
    the least-loaded engine once it is over, whatever fraction of the prompt it is."""
    view = _queued_view()
    policy = _warmed(PrefixHRW(balance_factor=100.0), view)
    prefix = _text(22, 4096)  # depths 512 .. 4096 and the whole prompt
    request = _request(prefix, tokens=1100)
    first = policy.choose(request, view)
    policy.on_routed(request, first.engine_ids[0])
    keys = [h for _, h in policy.keys(request)]
    assert [policy.hot.share(h) > 0 for h in keys] == [True] * 3 + [False] * 2
    assert all(policy.seen.share(h) > 0 for h in keys)
    home = first.chosen
    least = (home + 1) % 4
    view.queued_loads[:] = 5000
    view.queued_loads[least] = 0
    view.queued_loads[home] = 1000  # 1000 more than the least-loaded: under 1024 saved
    decision = policy.choose(request, view)
    assert (decision.chosen, decision.reason) == (home, "prefix-home")
    view.queued_loads[home] = 1100  # the queue costs more than the cache saves
    decision = policy.choose(request, view)
    assert (decision.chosen, decision.reason) == (least, "cost-spill")


def _routed_once(
    policy: PrefixHRW, seed: int
) -> tuple[StaticFleetView, PrefixHRW, RouteRequest, int]:
    """``policy`` warmed on a 4-engine queued view, after routing one 4096-byte request
    (seed ``seed``) to its home: its 4096-byte depth is seen, a 1024-token saving. Returns
    the view, the policy, the request and its home."""
    view = _queued_view()
    _warmed(policy, view)
    request = _request(_text(seed, 4096), tokens=1100)
    first = policy.choose(request, view)
    policy.on_routed(request, first.engine_ids[0])
    return view, policy, request, first.chosen


def test_the_cost_spill_pays_for_the_queue_it_joins() -> None:
    """A spilled request prefills its prefix again and delays whatever queues behind it
    at the target, so it goes only when the home's extra queue exceeds the saving (1024
    tokens: the request's 4096-byte depth was seen) plus the target's own queue."""
    view, policy, request, home = _routed_once(PrefixHRW(balance_factor=100.0), 23)
    view.queued_loads[:] = 9000
    view.queued_loads[home] = 5000
    target = (home + 2) % 4
    view.queued_loads[target] = 1988  # 5000 - 1988 = 3012 = 1024 + 1988: not more
    decision = policy.choose(request, view)
    assert (decision.chosen, decision.reason) == (home, "prefix-home")
    view.queued_loads[target] = 1987  # 3013 > 1024 + 1987
    decision = policy.choose(request, view)
    assert (decision.chosen, decision.reason) == (target, "cost-spill")


def test_the_cost_spill_pays_for_the_decodes_its_re_prefill_stalls() -> None:
    """The re-prefilled saving (1024 tokens) stalls every request in flight at the target
    between two of its tokens: at ``stall_weight = 0.1`` each of them costs the spill
    102.4 tokens of queue more, so with 10 in flight the home's extra queue must exceed
    1024 + L_t + 1024 (the same home and target spill with none in flight, or at
    ``stall_weight = 0``). Only the target's in-flight count matters."""
    for weight, in_flight, spills in [(0.1, 0, True), (0.1, 10, False), (0.0, 10, True)]:
        policy = PrefixHRW(balance_factor=100.0, stall_weight=weight)
        view, policy, request, home = _routed_once(policy, 23)
        target = (home + 2) % 4
        view.queued_loads[:] = 9000
        view.queued_loads[home] = 2000  # 2000 - 0 > 1024 + 0, not > 1024 + 0 + 1024
        view.queued_loads[target] = 0
        view.loads[:] = 50  # the home and the others: no part of the price
        view.loads[target] = in_flight
        decision = policy.choose(request, view)
        want = (target, "cost-spill") if spills else (home, "prefix-home")
        assert (decision.chosen, decision.reason) == want, (weight, in_flight)
        view.queued_loads[home] = 2049  # 2049 > 1024 + 1024: over the stall's price
        assert policy.choose(request, view).chosen == target
    with pytest.raises(PolicyConfigError, match="stall_weight"):
        make_policy("prefix-hrw", stall_weight=-0.1)


def test_the_cost_spill_counts_prefill_time_on_engines_of_unequal_speed() -> None:
    """With the engines' relative prefill times (``prefill_cost``: 1 the fastest) every
    term of the spill is time: the target is where the request starts soonest, its queue
    plus its re-prefill (1024 tokens) times the engine's cost, not the shortest queue in
    tokens; and a slow home's queue weighs its cost."""
    view, policy, request, home = _routed_once(PrefixHRW(balance_factor=100.0), 23)
    slow, fast, other = ((home + j) % 4 for j in (1, 2, 3))
    view.queued_loads[:] = 0
    view.queued_loads[[home, fast, other]] = (5000, 1000, 9000)
    # In tokens the empty slow engine is the least loaded: 5000 - 0 > 1024 + 0.
    assert (policy.choose(request, view).chosen, policy.choose(request, view).reason) == (
        slow,
        "cost-spill",
    )
    costs = np.ones(4)
    costs[[slow, other]] = 4.0
    view.prefill_costs = costs
    # In time it starts at (0 + 1024) * 4 = 4096 there, at (1000 + 1024) * 1 = 2024 on the
    # fast one, which gains 5000 - 1000 = 4000 > 2024.
    decision = policy.choose(request, view)
    assert (decision.chosen, decision.reason) == (fast, "cost-spill")
    # A slow home: 2000 queued tokens there take 8000; the fast engine's 2000 take 2000,
    # 6000 less, more than (1024 + 2000) * 1. In tokens the two are level: no spill.
    costs[:] = 1.0
    costs[[home, slow]] = 4.0
    view.queued_loads[[home, fast]] = (2000, 2000)
    view.queued_loads[slow] = 9000
    decision = policy.choose(request, view)
    assert (decision.chosen, decision.reason) == (fast, "cost-spill")
    view.prefill_costs = None
    assert policy.choose(request, view).chosen == home


def test_the_load_bound_yields_only_past_the_stall_its_spill_would_cause() -> None:
    """Leaving the first home over its bound re-prefills the saving (1024 tokens) where the
    bound sends the request, so the home's slack grows by that engine's stall, ``w · 1024 ·
    n_t``: with 20 requests in flight there (2048 tokens) a home at 2400 queued tokens keeps
    the request (4 engines, c = 2: 4 (2400 - 1024 - 2048) <= 2 (300 + 2400)) where the
    plain slack (4 (2400 - 1024) > 2 · 2700) spills it, and so does a target with nothing
    in flight. The cost spill prices the same stall, so it does not take the request
    either (2400 - 100 <= 1024 + 100 + 2048)."""
    for weight, in_flight, stays in [(0.1, 20, True), (0.0, 20, False), (0.1, 0, False)]:
        view, policy, request, home = _routed_once(PrefixHRW(stall_weight=weight), 24)
        view.queued_loads[:] = 100
        view.queued_loads[home] = 2400
        view.loads[:] = in_flight
        view.loads[home] = 0  # the home's own count is no part of the price
        decision = policy.choose(request, view)
        if stays:
            assert (decision.chosen, decision.reason) == (home, "prefix-home")
        else:
            assert decision.chosen != home, (weight, in_flight)
            assert decision.reason in ("prefix-spill", "bounded-spill", "cost-spill")


def test_the_load_bound_yields_by_what_staying_saves() -> None:
    """Rule 2 with ``affinity_slack``: the first home keeps the request while its queue
    less the saving (1024 tokens: the request's 4096-byte depth was seen) is within bound;
    at ``affinity_slack = 0`` any excess spills it (the bound of requests that save
    nothing). The cost spill still decides once the queue is worth more than the cache."""
    for slack, stays in [(1.0, True), (0.0, False)]:
        view, policy, request, home = _routed_once(PrefixHRW(affinity_slack=slack), 24)
        view.queued_loads[:] = 100
        # Over 4 engines at c = 2 the bound is 4 L <= 2 (300 + L), L <= 300; the cost
        # spill needs L - 100 > 1024 + 100.
        view.queued_loads[home] = 1000
        decision = policy.choose(request, view)
        if stays:  # 4 (1000 - 1024) <= 2 * 1300
            assert (decision.chosen, decision.reason) == (home, "prefix-home")
        else:
            assert decision.chosen != home
            assert decision.reason in ("prefix-spill", "bounded-spill")
        view.queued_loads[home] = 1300
        decision = policy.choose(request, view)
        assert decision.chosen != home
        assert decision.reason == "cost-spill" if stays else decision.reason != "prefix-home"
    with pytest.raises(PolicyConfigError, match="affinity_slack"):
        make_policy("prefix-hrw", affinity_slack=-0.5)


def test_a_request_follows_its_prefix_to_where_it_was_last_sent() -> None:
    """A spill places a prefix away from its rendezvous home: the request that extends it
    goes where the deepest depth of it the seen table holds was last sent (reason
    ``"prefix-follow"``, that depth its saving: 4096 bytes, 1024 tokens), not to the
    home. Not when that engine is ineligible, over its load bound less the saving, or not
    known, nor for a session the client declared (never moved off its key's home)."""
    view, policy, request, home = _routed_once(PrefixHRW(balance_factor=1.0), 26)
    there = (home + 1) % 4
    ids = [int(x) for x in view.selector.engine_ids]
    policy.on_routed(request, ids[there])  # the same prefix, later sent elsewhere
    follow_up = _request(request.prefix + _text(27, 2000), tokens=1600)
    decision = policy.choose(follow_up, view)
    assert (decision.chosen, decision.reason) == (there, "prefix-follow")
    assert (decision.scores[0], decision.cached_tokens) == (4096.0, 1024)
    assert home in decision.ranked  # the failover keeps the rest of the ranking
    session = RouteRequest(7, 0, 1600, follow_up.prefix, None, key_depth_bytes=0)
    assert policy.choose(session, view).reason == "prefix-home"  # declared: its own home

    mask = np.ones(4, dtype=bool)
    mask[there] = False
    view.set_available(mask)
    assert policy.choose(follow_up, view).chosen == home  # ineligible: the home
    view.set_available(np.ones(4, dtype=bool))

    # Over its bound less the saving (4 engines, c = 1: 4 (L - 1024) <= 3000 + L), before
    # the cost spill would take it (L - 1000 > 1024 + 1000)
    view.queued_loads[:] = 1000
    view.queued_loads[there] = 2300  # 4 * 1276 = 5104 <= 5300: still follows
    assert policy.choose(follow_up, view).chosen == there
    view.queued_loads[there] = 2500  # 4 * 1476 = 5904 > 5500
    decision = policy.choose(follow_up, view)
    assert (decision.chosen, decision.reason) == (home, "prefix-home")
    view.queued_loads[:] = 0

    policy.on_routed(request, 0)  # sent, engine not known: no placement to follow
    assert policy.choose(follow_up, view).reason == "prefix-home"
    policy.on_routed(request, engine_id("not-in-the-table"))
    assert policy.choose(follow_up, view).chosen == home


def test_a_followed_request_still_pays_the_cost_spill() -> None:
    """The engine a request follows to is its home for rule 3: a queue there worth more
    than the saving (1024 tokens) plus the target's own queue spills it."""
    view, policy, request, home = _routed_once(PrefixHRW(balance_factor=100.0), 28)
    there = (home + 1) % 4
    policy.on_routed(request, int(view.selector.engine_ids[there]))
    follow_up = _request(request.prefix + _text(29, 2000), tokens=1600)
    view.queued_loads[:] = 9000
    view.queued_loads[there] = 1024
    view.queued_loads[(home + 2) % 4] = 0
    assert policy.choose(follow_up, view).reason == "prefix-follow"  # 1024 - 0 <= 1024 + 0
    view.queued_loads[there] = 1025
    decision = policy.choose(follow_up, view)
    assert (decision.chosen, decision.reason) == ((home + 2) % 4, "cost-spill")


def test_the_decision_says_what_it_expects_cached_at_the_chosen_engine() -> None:
    """``cached_tokens`` is the saving the rules counted at ``ranked[0]`` (the deepest
    depth of the request the seen table holds, at least the deciding key's, in tokens):
    128 before the prefix was ever routed (its 512-byte deciding key), 1024 once its
    4096-byte depth was, but at most the prompt less ``queued_floor_tokens`` (1100 - 128),
    and 0 after a cost spill (the target holds none of it). A queued prefill counts the
    prompt less it, at the chosen engine only."""
    view = _queued_view()
    policy = _warmed(PrefixHRW(balance_factor=100.0), view)
    request = _request(_text(25, 4096), tokens=1100)
    first = policy.choose(request, view)
    assert (first.reason, first.cached_tokens) == ("prefix-home", 128)
    policy.on_routed(request, first.engine_ids[0])
    again = policy.choose(request, view)
    assert (again.chosen, again.reason, again.cached_tokens) == (first.chosen, "prefix-home", 972)
    assert again.queued_prefill_tokens(again.chosen, 1100) == 128
    assert again.queued_prefill_tokens(again.ranked[1], 1100) == 1100
    assert again.queued_prefill_tokens(again.chosen, 900) == 1  # never below one token
    view.queued_loads[:] = 0
    view.queued_loads[first.chosen] = 5000
    spilled = policy.choose(request, view)
    assert (spilled.reason, spilled.cached_tokens) == ("cost-spill", 0)


def test_workers_sharing_a_key_log_decide_as_one_worker() -> None:
    """Three workers over one key log, each request decided and routed by a random one of
    them: every decision is the one a single worker that saw all the requests makes (each
    drains the others' entries, in order, before deciding)."""
    log = private_key_log(64)
    view, alone = _view(6), PrefixHRW(hot_half_life_requests=50.0)
    workers = [PrefixHRW(hot_half_life_requests=50.0) for _ in range(3)]
    for w, policy in enumerate(workers):
        assert policy.attach_key_log(log, w, 0) is not None
    rng = np.random.default_rng(4)
    system = _text(1, 1500)
    for s in range(300):
        head = system if rng.random() < 0.6 else b""
        request = _request(head + _text(int(rng.integers(0, 30)), 2000), key=s)
        view.queued_loads = rng.integers(0, 4, size=6).astype(np.int64) * 400
        worker = workers[int(rng.integers(0, 3))]
        decision = worker.choose(request, view)
        assert decision == alone.choose(request, view), s
        worker.on_routed(request, decision.engine_ids[0])
        alone.on_routed(request, decision.engine_ids[0])
    assert max(w.hot.requests for w in workers) == alone.hot.requests == 300


def test_policies_without_history_ignore_the_key_log() -> None:
    log = private_key_log(16)
    assert make_policy("least-request").attach_key_log(log, 1, 0) is None


@pytest.mark.parametrize("chat", [False, True])
def test_a_prompt_sent_by_everybody_spreads_over_the_fleet(chat: bool) -> None:
    """One prompt repeated by every client (a load test, a fixed instruction): every key of
    it is hot and none splits it, and its decodes are invisible to the token bound (nothing
    is left to prefill). Once its whole prompt is hot it is ranked by a salted key
    (``"repeat-spread"``), so the repeats cover the fleet by weight instead of one home;
    as a completion prompt (no routing key) and as a chat (one conversation key)."""
    view = _view(8)
    policy = _warmed(PrefixHRW(hot_half_life_requests=100), view)
    prompt = _text(40, 2000)
    chosen, reasons = [], set()
    for s in range(400):
        request = RouteRequest(
            key_hash=4242, row=0, prompt_tokens=500, prefix=prompt,
            key_depth_bytes=len(prompt) if chat else -1,
        )  # fmt: skip
        decision = policy.choose(request, view)
        policy.on_routed(request, decision.engine_ids[0])
        if s >= 100:
            chosen.append(decision.chosen)
            reasons.add(decision.reason)
            assert decision.cached_tokens == 500 - 128  # the whole prompt, seen, less the floor
    assert reasons == {"repeat-spread"}
    counts = [chosen.count(i) for i in range(8)]
    assert min(counts) > 0 and max(counts) <= 2 * len(chosen) / 8, counts


def test_a_new_prompt_sent_by_many_spreads_long_before_its_groups_turn_hot() -> None:
    """A prompt that starts to be half of the traffic is spread once its whole prompt's
    share, with a half-life of 16 requests per engine, crosses ``h / n`` (about the 14th
    time it is sent at n = 4), while its depth keys' share, with the default half-life of
    1024 requests, is still far below it (before, the spread waited for them: about 200
    requests). The first one hundred times it is sent, it goes to every engine."""
    view = _view(4)
    policy = _warmed(PrefixHRW(), view, requests=400)  # the shares' totals settled
    prompt = _text(44, 2000)
    chosen, first_spread, group_share = [], None, 1.0
    for s in range(100):
        request = _request(prompt, key=4343, tokens=500)
        decision = policy.choose(request, view)
        policy.on_routed(request, decision.engine_ids[0])
        if decision.reason == "repeat-spread":
            if first_spread is None:
                first_spread, group_share = s, policy.hot.share(policy.keys(request)[0][1])
            chosen.append(decision.chosen)
        other = _request(_text(9000 + s, 700), key=9000 + s, tokens=175)
        policy.on_routed(other, policy.choose(other, view).engine_ids[0])
    assert first_spread is not None and 10 <= first_spread <= 20, first_spread
    assert group_share < 0.125 / 2  # below even the share at which a hot group cools
    assert len(set(chosen)) == 4 and max(chosen.count(i) for i in range(4)) <= len(chosen) / 2


def test_a_repeated_prompt_gets_as_many_replicas_as_its_share_needs() -> None:
    """A prompt sent by a fifth of the requests on 8 engines needs ``ceil(0.2 / (0.5 / 8))
    = 4`` replicas for each to carry at most a hot group's share: its repeats take the
    first four engines of its whole key's ranking in turn (not all eight: each replica
    prefills it once), about equally."""
    view = _view(8)
    policy = _warmed(PrefixHRW(), view, requests=400)
    prompt = _text(45, 2000)
    chosen = []
    for s in range(500):
        if s % 5 == 0:
            request = _request(prompt, key=4444, tokens=500)
        else:
            request = _request(_text(11000 + s, 700), key=11000 + s, tokens=175)
        decision = policy.choose(request, view)
        policy.on_routed(request, decision.engine_ids[0])
        if decision.reason == "repeat-spread" and s >= 250:
            chosen.append(decision.chosen)
    whole = policy.keys(_request(prompt, key=4444, tokens=500))[-1][1]
    replicas = view.selector.tree_rank(whole, 0, 5)
    assert len(chosen) == 50 and set(chosen) <= set(replicas), (chosen, replicas)
    counts = sorted(chosen.count(i) for i in set(chosen))
    assert 3 <= len(counts) <= 5 and counts[-1] <= 2 * len(chosen) / len(counts), counts


def test_a_hot_prefix_with_unique_tails_past_its_last_depth_spreads() -> None:
    """Completion prompts that share a 2 kB system prompt and differ only after it, below
    the next depth (2048 < length < 4096): every depth key is the system prompt's, hot.
    The whole prompt is their deepest key, unique, so they spread as their sub-groups."""
    view = _view(8)
    policy = _warmed(PrefixHRW(hot_half_life_requests=100), view)
    system = _text(41, 2048)
    chosen = []
    for s in range(300):
        request = _request(system + _text(6000 + s, 900), tokens=740)
        decision = policy.choose(request, view)
        policy.on_routed(request, decision.engine_ids[0])
        if s >= 100:
            chosen.append(decision.chosen)
            assert decision.scores[0] == 2948.0  # the whole prompt's depth
    assert len(set(chosen)) == 8 and max(chosen.count(i) for i in chosen) <= 50  # mean 25


def test_a_hot_session_whose_prompt_grows_is_not_spread() -> None:
    """An agent session that is half of the traffic is hot at every key, but its prompt
    grows each step, so its whole prompt is never hot: it is not spread (it keeps the
    rules' engine, with its cache), and its whole keys are counted only while the rest are
    hot."""
    view = _view(4)
    policy = _warmed(PrefixHRW(hot_half_life_requests=100), view)
    base = _text(42, 9000)
    engines, reasons = [], set()
    for step in range(150):
        prompt = base + _text(7000 + step // 10, 300 * (step + 1))[: 300 * (step + 1)]
        request = RouteRequest(
            key_hash=777, row=0, prompt_tokens=len(prompt) // 4, prefix=prompt,
            key_depth_bytes=len(base),
        )  # fmt: skip
        decision = policy.choose(request, view)
        policy.on_routed(request, decision.engine_ids[0])
        engines.append(decision.chosen)
        reasons.add(decision.reason)
        other = _request(_text(8000 + step, 700), tokens=175)
        policy.on_routed(other, policy.choose(other, view).engine_ids[0])
    assert "repeat-spread" not in reasons
    moves = sum(a != b for a, b in zip(engines[50:], engines[51:], strict=False))
    assert moves <= 10, (moves, engines)


def test_a_declared_session_repeating_one_prompt_keeps_its_home() -> None:
    """A session id the client sent is never spread by a salt, even when it repeats one
    prompt: once hot it is ranked by its deepest key (rule 1), one engine."""
    view = _view(8)
    policy = _warmed(PrefixHRW(hot_half_life_requests=100), view)
    prompt = _text(43, 2000)
    chosen, reasons = [], set()
    for _ in range(300):
        request = RouteRequest(key_hash=99, row=0, prompt_tokens=500, prefix=prompt,
                               key_depth_bytes=0)  # fmt: skip
        decision = policy.choose(request, view)
        policy.on_routed(request, decision.engine_ids[0])
        chosen.append(decision.chosen)
        reasons.add(decision.reason)
    assert "repeat-spread" not in reasons
    assert len(set(chosen[100:])) == 1


def test_a_queue_of_cached_requests_counts_the_floor_each() -> None:
    """A request whose prompt is cached at its home still waits for a slot there: each
    queued attempt counts ``queued_floor_tokens`` (128), so a home with a queue of them
    gives up the next within a few (at one token each it took about as many requests as
    the prompt has tokens); a prompt shorter than the floor counts whole."""
    view = _queued_view()
    policy = _warmed(PrefixHRW(), view)
    request = _request(_text(50, 3600), tokens=900)
    first = policy.choose(request, view)
    policy.on_routed(request, first.engine_ids[0])
    home, queued = first.chosen, 0
    while queued < 40:
        decision = policy.choose(request, view)
        if decision.chosen != home:
            break
        assert decision.queued_prefill_tokens(home, 900) == 128
        view.queued_loads[home] += 128
        queued += 1
    assert decision.chosen != home and 4 <= queued <= 16, queued
    short = policy.choose(_request(_text(51, 600), tokens=100), view)
    assert short.cached_tokens == 0 and short.queued_prefill_tokens(short.chosen, 100) == 100
    with pytest.raises(PolicyConfigError, match="queued_floor_tokens"):
        make_policy("prefix-hrw", queued_floor_tokens=0)
