"""``bench/bench_peer_poll_cost.py``: two real serve trees polling each other, a short window."""

from __future__ import annotations

import argparse
import asyncio

import pytest
from bench_peer_poll_cost import main


@pytest.mark.integration
def test_a_short_run_counts_the_polls_it_prices() -> None:
    args = argparse.Namespace(intervals=[0.0, 0.05], seconds=1.0, settle=0.5, no_exchange=False)
    out = asyncio.run(main(args))
    baseline, polled = out["runs"]
    assert baseline["interval_s"] == 0.0 and baseline["polls_ok_per_s_per_host"] == 0.0
    assert "cpu_us_per_poll_pair" not in baseline  # nothing to price
    # 20 polls a second at 0.05 s: the two proxies really polled each other in the window
    assert polled["interval_s"] == 0.05 and polled["polls_ok_per_s_per_host"] >= 5
    assert set(polled) == {
        "interval_s",
        "cpu_ms_per_s_per_host",
        "polls_ok_per_s_per_host",
        "polls_cpu_ms_per_s_per_host",
        "cpu_us_per_poll_pair",
    }
