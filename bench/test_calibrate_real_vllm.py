"""The real-engine calibration's decode window (``calibrate_real_vllm.steady_step_s``).

Plain tests, not benchmarks: the window is pure arithmetic over token arrival times, so
it is checked here, where it runs on every ``make test``, rather than only behind a live
vLLM in ``make test-real``.
"""

from __future__ import annotations

import pytest
from calibrate_real_vllm import NoDecodeWindow, steady_step_s


def _stream(first_s: float, step_s: float, tokens: int) -> list[float]:
    return [first_s + i * step_s for i in range(tokens)]


def test_the_window_is_where_every_stream_decodes() -> None:
    # Three streams, 1/64 s steps (exact in binary), first tokens a step apart.
    step_s = 1 / 64
    streams = [_stream(i * step_s, step_s, 30) for i in range(3)]
    assert steady_step_s(streams) == pytest.approx(step_s)


def test_a_stream_read_in_one_burst_is_left_out() -> None:
    # The lagged client read all 30 tokens at t = 0.25: with it, the window would be empty.
    step_s = 1 / 64
    good = [_stream(0.0, step_s, 30), _stream(step_s, step_s, 30)]
    burst = [0.25] * 30
    assert steady_step_s([*good, burst]) == pytest.approx(step_s)


def test_every_stream_in_one_burst_has_no_window() -> None:
    with pytest.raises(NoDecodeWindow, match="one read"):
        steady_step_s([[0.5] * 8, [0.7] * 8])


def test_streams_that_never_overlap_have_no_window() -> None:
    # One finished before the other started: no step where both decode.
    with pytest.raises(NoDecodeWindow, match="every stream decodes"):
        steady_step_s([_stream(0.0, 0.01, 10), _stream(1.0, 0.01, 10)])
