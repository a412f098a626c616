"""Eligibility: the cached masks and reasons behave like the work they replace."""

from __future__ import annotations

import numpy as np

from fastroute.config import decode_config
from fastroute.guards.outlier import Outcome
from fastroute.proxy.path.fleet import Fleet

_CONFIG = (
    "".join(
        f'[[engines]]\nname = "e{i}"\nurl = "http://127.0.0.1:{9000 + i}"\nmodels = ["m"]\n'
        f'zone = "{"us" if i < 2 else "eu"}"\ncapacity_rps = 10.0\n\n'
        for i in range(3)
    )
    + "[ejection]\nconsecutive_failures = 1\nmax_ejected_fraction = 1.0\n"
    + '[[network.regions]]\nname = "local"\nzone = "us"\n'
    + '[[network.regions]]\nname = "eu-west"\nzone = "eu"\n'
    + "[network.rtt_ms]\nlocal = { eu-west = 80.0 }\n"
)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _fleet() -> tuple[Fleet, _Clock]:
    clock = _Clock()
    return Fleet(decode_config(_CONFIG), clock=clock), clock


def _uncached(fleet: Fleet, row: int, mask: np.ndarray) -> np.ndarray:
    state = fleet.state
    ok = fleet.outlier.available_mask(fleet.clock()).astype(bool)
    return (state.positive[row] & state.available & ok & mask).astype(np.uint8)


def test_eligible_cache_follows_ejections_and_states() -> None:
    """Eligible cache follows ejections and states."""
    fleet, clock = _fleet()
    row = fleet.rows[("m", "default")]
    us = fleet.eligibility.request_mask(frozenset({"us"}), None)
    every = fleet.eligibility.request_mask(frozenset({"us", "eu"}), None)
    for mask in (us, every):
        assert fleet.view(mask).eligible(row).tolist() == _uncached(fleet, row, mask).tolist()
    assert fleet.view(us).eligible(row).tolist() == [1, 1, 0]
    # An ejection takes effect at once...
    assert fleet.outlier.record(0, Outcome.CONNECT_ERROR, clock.now)
    assert fleet.view(us).eligible(row).tolist() == [0, 1, 0]
    assert fleet.view(every).eligible(row).tolist() == [0, 1, 1]
    # ...and so does its end.
    clock.now += 3600.0
    assert fleet.view(us).eligible(row).tolist() == [1, 1, 0]
    # A new state (weights) invalidates the cache too.
    weights = fleet.state.weights.copy()
    weights[row, 1] = 0.0
    fleet.state = fleet._make_state(7, None, weights, None, None, None)
    assert fleet.view(us).eligible(row).tolist() == [1, 0, 0]


def test_ejection_reasons_cached_per_version() -> None:
    """Ejection reasons cached per version."""
    fleet, clock = _fleet()
    assert fleet.eligibility.ejection_reasons() == {}
    fleet.outlier.record(2, Outcome.TIMEOUT, clock.now)
    reasons = fleet.eligibility.ejection_reasons()
    assert list(reasons) == [2] and reasons == fleet.outlier.reasons(clock.now)
    clock.now += 3600.0
    assert fleet.eligibility.ejection_reasons() == {}
