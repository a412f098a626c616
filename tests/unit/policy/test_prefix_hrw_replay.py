"""``prefix-hrw`` decides exactly as before its per-request work moved into the core.

A recorded request sequence (several prompt shapes, in-flight token loads that follow the
decisions, ejected engines, overloaded homes, idle phases, hot prefixes, retries) goes
through the frozen pure-Python reference (``_prefix_hrw_reference.py``, on the
pure-Python selector) and through the policy (the compiled core when it is built), and
every decision must be the same: engines, reason and scores. (``cached_tokens``, the
policy's estimate of the prefix cached at the chosen engine, came after the freeze and
changes no choice: the proxy counts the prompt less it as queued prefill. Its own tests are
in ``test_prefix_hrw.py``.)
"""

from __future__ import annotations

from collections import Counter

import msgspec
import numpy as np
import pytest
from _prefix_hrw_reference import ReferencePrefixHRW

from fastroute._core import SelectorPy
from fastroute.hashing import engine_id
from fastroute.policy import RouteRequest, StaticFleetView
from fastroute.policy.prefix_hrw import PrefixHRW

#: Requests per replay; enough for the share estimate to call groups hot.
REQUESTS = 1200
#: Every reason the policy gives must occur in the replays (else a path went untested).
REASONS = {
    "prefix-home",
    "prefix-spill",
    "bounded-spill",
    "cost-spill",
    "no-prefix",
    "prefix-follow",
    "repeat-spread",
}
PARAMS = [
    {},
    {"balance_factor": 1.25, "hot_half_life_requests": 200.0, "affinity_slack": 0.0},
    {
        "order": "deep",
        "hot_share_factor": 1.0,
        "hot_half_life_requests": 300.0,
        "affinity_slack": 3.0,
        "stall_weight": 1.0,
    },
    {
        "block_bytes": 256,
        "prefix_bytes": 4096,
        "hot_half_life_requests": 100.0,
        "stall_weight": 0.0,
    },
]


def _text(rng: np.random.Generator, n_bytes: int) -> bytes:
    return bytes(rng.integers(97, 123, size=n_bytes, dtype=np.uint8))


def _request(rng: np.random.Generator, system: bytes, conversations: list[bytes]) -> RouteRequest:
    """One request of a random shape."""
    shape = rng.choice(["unique", "hot", "hot", "short", "session", "chat", "repeat", "repeat"])
    key = int(rng.integers(0, 2**64, dtype=np.uint64))
    depth = -1
    if shape == "repeat":  # one of two prompts sent again and again, as chat or completion
        which = int(rng.integers(0, 2))
        prefix = system + conversations[which][:400]
        output = None if rng.random() < 0.3 else int(rng.integers(1, 400))
        if rng.random() < 0.5:
            key, depth = 5 + which, len(prefix)  # the conversation key of that prompt
        return RouteRequest(key, 0, len(prefix) // 4, prefix, output, depth)
    if shape == "unique":
        prefix = _text(rng, int(rng.integers(300, 20000)))
    elif shape == "short":
        prefix = _text(rng, int(rng.integers(0, 256)))
    else:
        # Zipf popularity: the first conversations are hot, the tail is not.
        popularity = 1.0 / np.arange(1, len(conversations) + 1)
        conv = conversations[rng.choice(len(conversations), p=popularity / popularity.sum())]
        prefix = system + conv + _text(rng, int(rng.integers(0, 3000)))
        if shape == "session":
            depth = 0
        elif shape == "chat":
            depth = len(system) + int(rng.integers(0, len(conv)))
    tokens = max(1, len(prefix) // 4 + int(rng.integers(-50, 50)))
    output = None if rng.random() < 0.3 else int(rng.integers(1, 400))
    return RouteRequest(key, 0, tokens, prefix, output, depth)


def _replay(n_engines: int, params: dict, seed: int) -> Counter:
    rng = np.random.default_rng(seed)
    ids = [engine_id(f"replay-{i}") for i in range(n_engines)]
    weights = rng.choice([0.0, 0.5, 1.0, 2.0], size=(1, n_engines), p=[0.1, 0.2, 0.5, 0.2])
    weights[0, 0] = 1.0
    new = StaticFleetView(ids, weights)
    old = StaticFleetView(ids, weights, selector=SelectorPy(ids, weights))
    old.token_loads = new.token_loads  # one load array: both see the same fleet
    old.loads = new.loads
    policy, reference = PrefixHRW(**params), ReferencePrefixHRW(**params)
    system = _text(rng, 2048)
    conversations = [_text(rng, int(rng.integers(600, 6000))) for _ in range(24)]
    in_flight: list[tuple[int, int, int]] = []  # (engine, tokens, finishes at step)
    reasons: Counter = Counter()
    for step in range(REQUESTS):
        if step % 97 == 0:  # eject a random engine, or bring all back
            mask = np.ones(n_engines, dtype=bool)
            if rng.random() < 0.7:
                mask[rng.integers(0, n_engines)] = False
            new.set_available(mask)
            old.set_available(mask)
        if step % 211 == 100:  # an idle phase: everything finished
            new.token_loads[:] = 0
            new.loads[:] = 0
            in_flight.clear()
        if step % 53 == 7:  # one engine far over its bound for a while
            new.token_loads[rng.integers(0, n_engines)] += 10**6
        request = _request(rng, system, conversations)
        k = int(rng.integers(1, 5))
        got, want = policy.choose(request, new, k), reference.choose(request, old, k)
        routing = msgspec.structs.replace(got, cached_tokens=0)
        assert routing == want, (step, request.key_depth_bytes, len(request.prefix))
        reasons[got.reason] += 1
        if not got.ranked:
            continue
        roll = rng.random()
        if roll < 0.9:
            routed = request
        elif roll < 0.97:  # a retry: an equal request object that choose did not see
            routed = RouteRequest(*(getattr(request, f) for f in RouteRequest.__struct_fields__))
        else:
            continue  # never sent
        policy.on_routed(routed, got.engine_ids[0])
        reference.on_routed(routed, want.engine_ids[0])
        tokens = request.prompt_tokens + (request.expected_output_tokens or 0)
        new.token_loads[got.ranked[0]] += tokens
        new.loads[got.ranked[0]] += 1
        in_flight.append((got.ranked[0], tokens, step + int(rng.integers(1, 60))))
        done = [f for f in in_flight if f[2] <= step]
        in_flight = [f for f in in_flight if f[2] > step]
        for engine, tokens_done, _ in done:
            new.token_loads[engine] = max(0, new.token_loads[engine] - tokens_done)
            new.loads[engine] = max(0, new.loads[engine] - 1)
    return reasons


@pytest.mark.parametrize(
    "params", PARAMS, ids=lambda p: ",".join(map(str, p.values())) or "default"
)
def test_decisions_match_the_reference_on_a_recorded_sequence(params: dict) -> None:
    reasons = _replay(8, params, seed=11) + _replay(48, params, seed=12)
    assert sum(reasons.values()) == 2 * REQUESTS
    assert "no-eligible-engine" not in reasons


def test_the_replays_exercise_every_reason() -> None:
    reasons: Counter = Counter()
    for i, params in enumerate(PARAMS):
        reasons += _replay(8, params, seed=100 + i)
    assert REASONS <= set(reasons), reasons
