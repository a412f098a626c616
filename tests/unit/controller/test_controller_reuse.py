"""controller.reuse: the capacity gain of prefix reuse from an engine group's token counters."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.reuse import DECODE_TOKEN_COST, GAIN_STEP, group_reuse_gains, reuse_gain

NAN = math.nan


def test_the_gain_is_the_token_work_saved_floored_to_the_grid() -> None:
    # 1000 queried, 500 cached, 0 generated: half the work, raw gain 2, floored to 1.1^7
    assert reuse_gain(1000, 500, 0, max_gain=4) == pytest.approx(GAIN_STEP**7)
    # a generated token costs DECODE_TOKEN_COST prefilled ones, with or without reuse: it
    # dilutes the gain; (1000 + 4·125) / (500 + 4·125) = 1.5
    assert DECODE_TOKEN_COST == 4.0
    assert reuse_gain(1000, 500, 125, max_gain=4) == pytest.approx(GAIN_STEP**4)  # 1.46
    assert reuse_gain(1000, 500, 125, max_gain=4, decode_token_cost=1) == pytest.approx(
        GAIN_STEP**6  # (1125 / 625 = 1.8)
    )
    # the bursty RAG family's counts (prefix-hrw, simulator): 69 % of 3301 cached, 201 out
    assert reuse_gain(3301, 0.69 * 3301, 201, max_gain=4) == pytest.approx(GAIN_STEP**8)  # 2.25
    with pytest.raises(ValueError, match="decode_token_cost"):
        reuse_gain(1, 0, 0, max_gain=4, decode_token_cost=0)


def test_no_evidence_is_no_gain_and_the_cap_bounds_it() -> None:
    assert reuse_gain(1000, 0, 100, max_gain=4) == 1.0  # nothing cached
    assert reuse_gain(0, 0, 0, max_gain=4) == 1.0  # no work in the window
    for unknown in ((NAN, 0, 1), (1, NAN, 1), (1, 0, NAN)):
        assert reuse_gain(*unknown, max_gain=4) == 1.0
    assert reuse_gain(100, 200, 1, max_gain=4) == 1.0  # more hits than queries: not counters
    assert reuse_gain(1000, 1000, 0, max_gain=4) == 4.0  # everything cached: the cap
    assert reuse_gain(1000, 990, 1, max_gain=4) == 4.0
    assert reuse_gain(1000, 990, 1, max_gain=1) == 1.0  # 1 turns it off
    with pytest.raises(ValueError, match="max_gain"):
        reuse_gain(1, 0, 0, max_gain=0.5)


@given(
    st.floats(1, 1e9), st.floats(0, 1), st.floats(0, 1e9), st.floats(1, 100), st.floats(0.1, 10),
)  # fmt: skip
def test_the_gain_never_exceeds_the_estimate_nor_falls_a_step_below_it(
    queried: float, hit_fraction: float, generated: float, max_gain: float, beta: float
) -> None:
    hit = queried * hit_fraction
    gain = reuse_gain(queried, hit, generated, max_gain=max_gain, decode_token_cost=beta)
    work = queried + beta * generated
    uncached = queried - hit + beta * generated
    raw = work / uncached if uncached > 0 else math.inf
    assert 1.0 <= gain <= max_gain
    assert gain <= raw * (1 + 1e-9)
    assert gain >= min(raw, max_gain) / GAIN_STEP * (1 - 1e-9)


def test_peers_share_one_gain_from_their_summed_counts() -> None:
    # group 0: two engines, 90 % and 10 % hits on equal tokens -> the group's 50 %
    # group 1: counted, nothing cached; group 2: its one engine does not count tokens
    gains = group_reuse_gains(
        [1000, 1000, 500, NAN], [900, 100, 0, NAN], [0, 0, 50, NAN], [0, 0, 1, 2], max_gain=4
    )
    assert gains.tolist() == pytest.approx([GAIN_STEP**7, GAIN_STEP**7, 1.0, 1.0])
    # an uncounted member adds nothing to its group's sums
    mixed = group_reuse_gains([1000, NAN], [500, NAN], [0, NAN], [0, 0], max_gain=4)
    assert mixed.tolist() == pytest.approx([GAIN_STEP**7] * 2)
    assert group_reuse_gains([], [], [], [], max_gain=4).size == 0
    with pytest.raises(ValueError, match="1-D"):
        group_reuse_gains([1, 2], [0], [0], [0, 0], max_gain=4)
    assert np.all(group_reuse_gains([5.0], [5.0], [0.0], [0], max_gain=2.5) == 2.5)
