"""``bench/bench_peer_poll_cost.py``: two real serve trees polling each other, a short window."""

from __future__ import annotations

import argparse
import asyncio

import pytest
from bench_peer_poll_cost import main


@pytest.mark.integration
def test_a_short_run_measures_the_baseline_and_a_period() -> None:
    args = argparse.Namespace(
        intervals=[0.0, 0.05], seconds=1.0, settle=0.5, workers=1, no_exchange=False
    )
    out = asyncio.run(main(args))
    baseline, polled = out["runs"]
    assert set(baseline) == {"interval_s", "cpu_ms_per_s_per_host"}  # nothing to subtract
    assert baseline["cpu_ms_per_s_per_host"] >= 0
    # two live proxies serving 20 polls a second each way use some CPU; the per-poll
    # figure is derived from the difference (its sign is the noise's at a 1 s window)
    assert polled["interval_s"] == 0.05 and polled["cpu_ms_per_s_per_host"] > 0
    assert set(polled) == {
        "interval_s",
        "cpu_ms_per_s_per_host",
        "polls_cpu_ms_per_s_per_host",
        "cpu_us_per_poll_pair",
    }
