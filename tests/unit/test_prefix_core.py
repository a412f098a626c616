"""The compiled ``prefix-hrw`` core against its spec: share table, keys and decisions.

Tests parametrised with ``impl`` run against every implementation present (the spec
``prefix_py`` always, the compiled ``prefix`` when the extension is built); the parity
tests compare the two value for value. Module-level ``parity`` marker: the suite is
re-run with ``FASTROUTE_NO_EXTENSIONS=1``.
"""

from __future__ import annotations

import numpy as np
import pytest

from fastroute import _core
from fastroute._core.prefix_py import depth_keys, whole_key
from fastroute.hashing import engine_id
from fastroute.policy import RouteRequest

pytestmark = pytest.mark.parity

HOT_KEYS = {"py": _core.HotKeysPy}
PICKERS = {"py": _core.PrefixPickerPy}
if _core.HotKeysC is not None:
    HOT_KEYS["cy"] = _core.HotKeysC
    PICKERS["cy"] = _core.PrefixPickerC


@pytest.fixture(params=sorted(HOT_KEYS), ids=sorted(HOT_KEYS))
def hot_keys(request: pytest.FixtureRequest) -> type:
    return HOT_KEYS[request.param]


@pytest.fixture(params=sorted(PICKERS), ids=sorted(PICKERS))
def picker(request: pytest.FixtureRequest) -> type:
    return PICKERS[request.param]


def test_pruning_drops_cold_then_the_least_recent_keys(hot_keys: type) -> None:
    hot = hot_keys(half_life_requests=1e9, max_keys=16)
    for i in range(16):
        hot.observe([1000 + i], 1.0 if i else 100.0)  # key 1000 carries most of the weight
    assert len(hot) == 16
    hot.observe([2000], 1.0)  # 17 keys: every key but 1000 is under total / 16 = 7.25
    assert len(hot) == 1 and hot.share(1000) > 0.0 and hot.share(2000) == 0.0
    hot.reset()
    for i in range(9):
        hot.observe([3000 + i], 100.0)  # nine heavy keys, one per tick
    for i in range(8):
        hot.observe([4000 + i], 1.0)  # the 17th key prunes: the light ones are cold
    # Nine heavy keys stay above the floor, more than 16 // 2: the least recent one goes.
    assert len(hot) == 8 and hot.share(3000) == 0.0
    assert all(hot.share(3000 + i) > 0.0 for i in range(1, 9))


def test_a_key_observed_twice_in_one_request_counts_twice(hot_keys: type) -> None:
    hot = hot_keys(half_life_requests=1e9)
    hot.observe([5, 5], 1.0)
    hot.observe([6], 2.0)
    assert hot.share(5) == pytest.approx(2.0 / 3.0) and hot.requests == 2


def test_the_table_grows_past_its_initial_size_and_resets(hot_keys: type) -> None:
    hot = hot_keys(half_life_requests=1e9, max_keys=4096)
    for i in range(3000):
        hot.observe([i], 1.0)
    assert len(hot) == 3000 and hot.share(2999) == pytest.approx(1 / 3000, rel=1e-5)
    hot.reset()
    assert len(hot) == 0 and hot.requests == 0 and hot.share(5) == 0.0
    hot.observe([5], 1.0)
    assert hot.share(5) == 1.0


def test_keys_are_the_depth_hashes_with_the_routing_key_at_its_depth(picker: type) -> None:
    prefix = bytes(range(256)) * 20  # 5120 bytes: depths 512 .. 4096
    p = picker(512, 32768, 2.0, 0.5, 1024.0)
    depths = depth_keys(prefix, 512)
    assert p.keys(prefix, 7, 1500) == [*depths[:2], (1500, 7), *depths[2:]]
    assert p.keys(prefix, 7, 0) == [(0, 7), *depths]
    assert p.keys(prefix[:100], 7, 1500) == [(0, 7)]
    # No routing key among them: the whole prompt read (and its tokens) is the deepest key.
    assert p.keys(prefix, 7, -1, 1300) == [*depths, (5120, whole_key(prefix, 1300))]
    assert p.keys(prefix[:100], 7, -1, 25) == [(0, 7)]
    short = picker(512, 1024, 2.0, 0.5, 1024.0)
    assert short.keys(prefix, 7, -1) == [*depths[:2], (1024, whole_key(prefix[:1024], 0))]


def test_the_whole_key_tells_prompts_apart_by_their_tokens() -> None:
    """Two prompts that agree on every byte read differ by their token counts (a
    session's context that grows past ``prefix_bytes``); the same prompt is one key."""
    read = b"x" * 2048
    assert whole_key(read, 9000) == whole_key(read, 9000)
    assert whole_key(read, 9000) != whole_key(read, 9001)
    assert whole_key(read, 9000) != whole_key(read[:-1], 9000)


# Defined only when the extension is built, so the pure-Python run has nothing to skip.
if "cy" in PICKERS:

    def test_compiled_shares_match_the_spec_bit_for_bit() -> None:
        rng = np.random.default_rng(3)
        for max_keys, half_life in [(16, 5.0), (64, 300.0), (1000, 1e9)]:
            py, cy = _core.HotKeysPy(half_life, max_keys), _core.HotKeysC(half_life, max_keys)
            universe = [int(x) for x in rng.integers(0, 2**64, size=200, dtype=np.uint64)]
            for step in range(3000):
                if step == 1500:  # a longer memory from now on (the whole prompts' table)
                    py.set_half_life(4 * half_life)
                    cy.set_half_life(4 * half_life)
                keys = [universe[int(i)] for i in rng.zipf(1.5, size=rng.integers(1, 6)) % 200]
                weight = float(rng.integers(1, 5000))
                py.observe(keys, weight)
                cy.observe(keys, weight)
                assert len(py) == len(cy) and py.requests == cy.requests
                probe = universe[int(rng.integers(0, 200))]
                assert py.share(probe) == cy.share(probe)
                enter = float(rng.random()) * 0.3
                assert py.is_hot(probe, enter, enter / 2) == cy.is_hot(probe, enter, enter / 2)
            assert [py.share(k) for k in universe] == [cy.share(k) for k in universe]

    def _scenario_request(
        rng: np.random.Generator,
        shared: list[bytes],
        earlier: list[bytes] | None = None,
        repeats: list[bytes] | None = None,
    ) -> RouteRequest:
        if repeats and rng.random() < 0.3:  # one of a few prompts sent again and again
            prompt = repeats[int(rng.integers(0, len(repeats)))]
            depth = int(rng.choice([-1, -1, 0, len(prompt)]))
            key = int(rng.integers(0, 2**64, dtype=np.uint64)) if depth == 0 else 17
            return RouteRequest(key, 0, len(prompt) // 4, prompt, 100, depth)
        head = shared[int(rng.integers(0, len(shared)))] if rng.random() < 0.7 else b""
        if earlier and rng.random() < 0.3:  # a follow-up: an earlier prompt, extended
            head = earlier[int(rng.integers(max(0, len(earlier) - 20), len(earlier)))]
        prefix = head + bytes(
            rng.integers(97, 123, size=int(rng.integers(0, 6000)), dtype=np.uint8)
        )
        depth = int(rng.choice([-1, -1, 0, int(rng.integers(0, 4000))]))
        output = None if rng.random() < 0.3 else int(rng.integers(0, 500))
        key = int(rng.integers(0, 2**64, dtype=np.uint64))
        return RouteRequest(key, 0, int(rng.integers(0, 3000)), prefix, output, depth)

    def test_compiled_decisions_match_the_spec() -> None:
        """choose and on_routed agree exactly on random fleets, masks, loads, in-flight
        counts and requests (including ties at the least load, many and few, over-bound
        homes, follow-ups of requests sent elsewhere than their home, to engines not in
        the table, or to no known engine, prompts repeated until they are hot, and engines
        of unequal prefill speed, with ties in their cost)."""
        rng = np.random.default_rng(5)
        followed = spread = timed_spills = 0
        for trial in range(12):
            n = int(rng.integers(1, 40))
            ids = [engine_id(f"p{trial}-{i}") for i in range(n)]
            weights = rng.random((1, n)) * (rng.random((1, n)) < 0.85)
            weights[0, 0] = 1.0
            sel = _core.SelectorC(ids, weights)
            params = (256, 8192, float(rng.choice([1.0, 1.25, 2.0])), 0.5, 50.0)
            deep = bool(trial % 3 == 0)
            stall = float(rng.choice([0.0, 0.1, 1.0]))
            py, cy = (
                _core.PrefixPickerPy(*params, deep=deep, stall_weight=stall),
                _core.PrefixPickerC(*params, deep=deep, stall_weight=stall),
            )
            shared = [bytes(rng.integers(97, 123, size=1500, dtype=np.uint8)) for _ in range(4)]
            repeats = [shared[0][: int(rng.integers(100, 1500))], shared[1] + shared[2]]
            earlier: list[bytes] = []
            reasons: set[str] = set()
            # Every other trial: engines of two to four speeds (ties in cost among them).
            cost = None
            if trial % 2:
                speeds = rng.choice([1.0, 1.0, 2.5, 8.0][: int(rng.integers(2, 5))], size=n)
                cost = np.asarray(speeds, dtype=np.float64)
                cost[0] = 1.0
            for step in range(300):
                mask = (rng.random(n) < 0.9).astype(np.uint8)
                levels = 1 if trial % 4 == 0 else int(rng.integers(1, 30))  # many ties or few
                loads = rng.integers(0, levels, size=n).astype(np.int64) * 100
                if step % 7 == 0:
                    loads[int(rng.integers(0, n))] += 10**6
                request = _scenario_request(rng, shared, earlier, repeats)
                earlier.append(request.prefix)
                k = int(rng.integers(1, 10))
                counts = rng.integers(0, 40, size=n).astype(np.int64)
                in_flight = None if step % 5 == 0 else (lambda c=counts: c)
                decision = py.choose(sel, request, mask, loads, k, in_flight, cost)
                assert decision == cy.choose(sel, request, mask, loads, k, in_flight, cost), (
                    trial,
                    step,
                )
                reasons.add(decision[1])
                timed_spills += cost is not None and decision[1] == "cost-spill"
                routed = request if rng.random() < 0.9 else _scenario_request(rng, shared)
                # where it went: mostly elsewhere than decided (retries, spills of another
                # worker), sometimes an engine not in the table or not known
                sent = int(rng.choice([0, 1, 2, 3, 4]))
                sent_id = (
                    ids[decision[0][0]] if sent == 0 and decision[0]
                    else ids[int(rng.integers(0, n))] if sent < 3
                    else engine_id("gone") if sent == 3
                    else 0
                )  # fmt: skip
                py.on_routed(routed, sent_id)
                cy.on_routed(routed, sent_id)
            assert py.hot.requests == cy.hot.requests and len(py.hot) == len(cy.hot)
            assert py.seen.requests == cy.seen.requests and len(py.seen) == len(cy.seen)
            followed += "prefix-follow" in reasons
            spread += "repeat-spread" in reasons
        assert followed >= 10  # the follow-ups exercised the last placement in most trials
        assert spread >= 10  # and the repeats went hot and were spread in most
        assert timed_spills >= 50  # the cost spill in prefill time decided many

    def test_compiled_choose_wants_the_compiled_selector() -> None:
        sel = _core.SelectorPy([1, 2], [[1.0, 1.0]])
        picker = _core.PrefixPickerC(512, 4096, 2.0, 0.5, 100.0)
        with pytest.raises(TypeError):
            picker.choose(sel, RouteRequest(1, 0), None, np.zeros(2, np.int64), 3)
