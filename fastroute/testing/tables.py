"""Seeded example weight tables for tests and benchmarks."""

from __future__ import annotations

import numpy as np

from fastroute.hashing import engine_id

__all__ = ["make_table"]


def make_table(n_engines: int, n_classes: int = 4, seed: int = 7) -> tuple[list[int], np.ndarray]:
    """Engine ids hashed from ``engine-<i>`` names and uniform(0.1, 1.1) weights."""
    rng = np.random.default_rng(seed)
    ids = [engine_id(f"engine-{i}") for i in range(n_engines)]
    return ids, rng.random((n_classes, n_engines)) + 0.1
