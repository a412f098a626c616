"""``bench/ttft_floor.py``: the solo-prefill floor is the step model's, and the floor of
the committed mooncake spec is what docs/fleet-benchmark.md quotes."""

from __future__ import annotations

from pathlib import Path

import pytest
from ttft_floor import floor, solo_prefill_s

from fastroute.fleetbench.spec import load_spec
from fastroute.hardware import get_profile

SPEC = Path(__file__).resolve().parent.parent / "examples/bench/families/mooncake-90.toml"


def test_a_solo_prefill_is_the_sum_of_its_chunks() -> None:
    profile = get_profile("a40-qwen2.5-3b")
    budget = profile.default_max_num_batched_tokens
    assert solo_prefill_s(profile, 0) == 0.0
    one = solo_prefill_s(profile, budget)
    assert one == pytest.approx(profile.prefill_time_s(budget, 0))
    two = solo_prefill_s(profile, budget + 10)
    assert two == pytest.approx(one + profile.prefill_time_s(10, budget))


def test_the_mooncake_floor_matches_the_documented_figures() -> None:
    f = floor(load_spec(SPEC))
    assert f["requests"] == 134
    assert f["share_over_slo"] == pytest.approx(0.306, abs=0.001)
    assert f["solo_ttft_p99_s"] == pytest.approx(4.94, abs=0.005)
