"""Fixtures for the policy tests: seeded fleets over ``StaticFleetView``."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from fastroute.hashing import engine_id
from fastroute.policy import StaticFleetView

MakeView = Callable[..., StaticFleetView]


def build_view(
    n_engines: int = 10,
    n_classes: int = 3,
    *,
    seed: int = 11,
    zero_fraction: float = 0.0,
    unavailable: tuple[int, ...] = (),
    weights: np.ndarray | None = None,
) -> StaticFleetView:
    """A fleet of ``engine-<i>`` engines with seeded weights, some zero, some ejected."""
    rng = np.random.default_rng(seed)
    ids = [engine_id(f"engine-{i}") for i in range(n_engines)]
    if weights is None:
        weights = rng.random((n_classes, n_engines)) + 0.1
        weights[rng.random(weights.shape) < zero_fraction] = 0.0
    available = np.ones(n_engines, dtype=bool)
    available[list(unavailable)] = False
    return StaticFleetView(ids, weights, available)


@pytest.fixture
def make_view() -> MakeView:
    """Factory for seeded fleets (see ``build_view``)."""
    return build_view
