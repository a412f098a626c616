"""PrefillInterleave: prefilled uncached prompt tokens per engine and per decode step."""

from __future__ import annotations

import pytest

from fastroute.predict.interleave import PrefillInterleave


def test_tokens_prefilled_during_a_decode_per_step():
    mix = PrefillInterleave(2, alpha=0.5)
    mix.prefilled(0, 300)  # before the request's first token: not beside its decode
    mark = mix.mark(0)
    mix.prefilled(0, 400)
    mix.prefilled(1, 1000)  # another engine
    mix.prefilled(0, 200)
    assert mix.per_step(0, mark, 60) == pytest.approx(10.0)
    assert mix.expected == [10.0, 0.0]
    # Expected = decayed Σ tokens / decayed Σ steps: (600/2 + 0) / (60/2 + 10).
    assert mix.per_step(0, mix.mark(0), 10) == 0.0  # nothing since
    assert mix.expected[0] == pytest.approx(300 / 40)
    assert mix.per_step(0, mark, 0) == 0.0 and mix.expected[0] == pytest.approx(300 / 40)


def test_a_short_request_beside_one_long_prompt_moves_the_expectation_little():
    """Weighted by decode steps: 9 requests of 100 steps with 1 token per step, then one
    of 2 steps beside a 2000-token prompt (1000 per step)."""
    mix = PrefillInterleave(1, alpha=0.1)
    for _ in range(9):
        mark = mix.mark(0)
        mix.prefilled(0, 100)
        mix.per_step(0, mark, 100)
    mark = mix.mark(0)
    mix.prefilled(0, 2000)
    assert mix.per_step(0, mark, 2) == pytest.approx(1000.0)
    assert mix.expected[0] < 5.0


def test_reported_cache_hits_discount_later_prompts():
    mix = PrefillInterleave(1, alpha=1.0)
    mix.observe_cached(0, 1000, 750)  # a quarter of the prompt was computed
    assert mix.uncached_share == [0.25]
    mix.prefilled(0, 800)
    assert mix.mark(0) == pytest.approx(200.0)
    mix.observe_cached(0, 100, 500)  # clipped to the prompt
    assert mix.uncached_share == [0.0]
    mix.observe_cached(0, 0, 0)  # ignored
    assert mix.uncached_share == [0.0]


def test_bad_arguments():
    with pytest.raises(ValueError, match="alpha"):
        PrefillInterleave(1, alpha=0.0)
    with pytest.raises(ValueError, match="n_engines"):
        PrefillInterleave(-1)
