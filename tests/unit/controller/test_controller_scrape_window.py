"""count_sum_window: the totals of histogram_window, exactly, without the buckets."""

from __future__ import annotations

import math
import random

from controller.scrape import count_sum_window
from fastroute.signals.vllm import CumulativeHistogram, histogram_window


def _hist(values: list[float]) -> CumulativeHistogram:
    les = (0.1, 0.5, 2.0, math.inf)
    counts = [float(sum(v <= le for v in values)) for le in les]
    buckets = tuple(zip(les, counts, strict=True))
    return CumulativeHistogram(sum(values), float(len(values)), buckets)


def test_matches_histogram_window_totals_and_resets() -> None:
    """Random growing histograms, a first scrape (no previous) and a restart (count fell)."""
    rng = random.Random(11)
    values = [rng.expovariate(2.0) for _ in range(50)]
    prev = None
    for n in (3, 3, 10, 27, 50):
        cur = _hist(values[:n])
        full = histogram_window(prev, cur)
        assert count_sum_window(prev, cur) == (full.count, full.sum)
        prev = cur
    restarted = _hist(values[:4])
    assert histogram_window(prev, restarted).reset
    assert count_sum_window(prev, restarted) is None
