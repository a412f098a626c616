"""The fleet's in-flight prompt tokens (what token-weighted policies read in the proxy) and its
reading of weight tables."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from fastroute.config import PRIORITIES, decode_config
from fastroute.hashing import class_key
from fastroute.policy import RouteRequest
from fastroute.policy.length_heuristic import LengthHeuristic
from fastroute.proxy.path.fleet import Fleet
from fastroute.tables import TableSnapshot

_CONFIG = (
    "".join(
        f'[[engines]]\nname = "e{i}"\nurl = "http://127.0.0.1:{9000 + i}"\nmodels = ["m"]\n'
        "capacity_rps = 10.0\n\n"
        for i in range(2)
    )
    + '[policy]\ndefault = "length-heuristic"\n'
)


def test_attempts_add_and_remove_their_prompt_tokens() -> None:
    fleet = Fleet(decode_config(_CONFIG, source="test.toml"))
    view = fleet.view(fleet.eligibility.request_mask(frozenset({"default"}), None))
    assert view.in_flight_tokens().tolist() == [0.0, 0.0]
    fleet.attempt_started(0, 1500)
    fleet.attempt_started(0, 20)
    fleet.attempt_started(1, 300)
    assert view.in_flight_tokens().tolist() == [1520.0, 300.0]
    assert view.in_flight().tolist() == [2, 1]
    fleet.attempt_finished(0, 1500)
    assert view.in_flight_tokens().tolist() == [20.0, 300.0]


def test_queued_tokens_last_until_the_prefill_is_done() -> None:
    """An attempt's prompt counts as queued from its forward until ``done`` (its first
    token or its end), once: a second ``done`` (first token, then the attempt's end)
    removes nothing more."""
    fleet = Fleet(decode_config(_CONFIG, source="test.toml"))
    view = fleet.view(fleet.eligibility.request_mask(frozenset({"default"}), None))
    a = fleet.attempt_started(0, 1500 + 200, 1500)
    b = fleet.attempt_started(0, 40 + 10, 40)
    decode_step = fleet.attempt_started(1, 300, 0)  # a P/D decode step: nothing queued
    assert view.queued_tokens().tolist() == [1540, 0]
    a.done()
    a.done()
    assert view.queued_tokens().tolist() == [40, 0]
    assert view.in_flight_tokens().tolist() == [1750, 300]  # still in flight: decoding
    b.done()
    decode_step.done()
    assert view.queued_tokens().tolist() == [0, 0]


def test_the_prefill_cost_is_the_fastest_engines_capacity_over_each_ones() -> None:
    """Engines of equal capacity are alike (None: the policy's spill counts tokens);
    otherwise each engine's time per prefilled token relative to the fastest's."""
    fleet = Fleet(decode_config(_CONFIG, source="test.toml"))
    view = fleet.view(fleet.eligibility.request_mask(frozenset({"default"}), None))
    assert view.prefill_cost() is None
    mixed = _CONFIG.replace("capacity_rps = 10.0", "capacity_rps = 40.0", 1)
    fleet = Fleet(decode_config(mixed, source="test.toml"))
    view = fleet.view(fleet.eligibility.request_mask(frozenset({"default"}), None))
    assert view.prefill_cost().tolist() == [1.0, 4.0]


def test_length_heuristic_in_the_proxy_weighs_long_prompts_by_tokens() -> None:
    """A long prompt goes to the engine with fewer prompt tokens in flight although it has
    more requests in flight; a short one to the engine with fewer requests."""
    config = decode_config(_CONFIG, source="test.toml")
    assert config.policy.default == "length-heuristic"
    fleet = Fleet(config)
    fleet.attempt_started(0, 1800)  # one long prefill
    for _ in range(3):
        fleet.attempt_started(1, 50)  # three short ones
    view = fleet.view(fleet.eligibility.request_mask(frozenset({"default"}), None))
    policy = LengthHeuristic(long_prompt_tokens=1024)
    row = fleet.rows[("m", "default")]
    long_req = RouteRequest(key_hash=7, row=row, prompt_tokens=1500)
    short_req = RouteRequest(key_hash=7, row=row, prompt_tokens=100)
    long_dec, short_dec = policy.choose(long_req, view), policy.choose(short_req, view)
    assert (long_dec.ranked[0], long_dec.reason) == (1, "long-prompt")
    assert (short_dec.ranked[0], short_dec.reason) == (0, "short-prompt")


def test_a_table_without_this_clusters_rows_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    """A table of another region (two regions' proxies on one host under one table name):
    capacity weights, and one warning naming the cluster — not one per generation."""
    fleet = Fleet(decode_config(_CONFIG, source="test.toml"))
    ids = fleet.engine_ids
    other = np.array([class_key("elsewhere", "m", p) for p in PRIORITIES], dtype=np.uint64)
    ours = fleet.row_keys

    def snap(gen: int, keys: np.ndarray) -> TableSnapshot:
        w = np.tile([1.0, 0.0], (len(keys), 1))
        return TableSnapshot.validated(gen, ids, w, class_keys=keys)

    with caplog.at_level(logging.WARNING, logger="fastroute.proxy.path.fleet"):
        for gen in (1, 2, 3):
            state = fleet.apply_snapshot(snap(gen, other))
    assert [r.getMessage().count("none for cluster 'local'") for r in caplog.records] == [1]
    assert state.weights[0].tolist() == [10.0, 10.0]  # capacity weights
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fastroute.proxy.path.fleet"):
        state = fleet.apply_snapshot(snap(4, ours))
        fleet.apply_snapshot(snap(5, other))
    assert state.weights[0].tolist() == [1.0, 0.0]
    assert len(caplog.records) == 1  # said again after a table that had its rows
