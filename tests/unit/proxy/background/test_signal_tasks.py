"""The engine state a worker reports: its own in-flight share, not the host's count."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastroute.config import decode_config
from fastroute.hashing import engine_id
from fastroute.proxy.background.signal_tasks import _engine_state
from fastroute.proxy.proxy_app import build_context
from fastroute.tables.stats import Counter, StatsBlock

_CONFIG = """
[[engines]]
name = "e0"
url = "http://127.0.0.1:9"
models = ["m"]
[[engines]]
name = "e1"
url = "http://127.0.0.1:10"
models = ["m"]
"""


def test_report_carries_this_workers_in_flight_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another worker's 5 requests to e0 are in the shared block (routing sees them),
    but this worker's report counts only its own 1: the controller sums the reports."""
    monkeypatch.setenv("FASTROUTE_SHM_DIR", str(tmp_path))
    config = decode_config(_CONFIG, source="t.toml")
    block = StatsBlock.create("report-share", [engine_id("e0"), engine_id("e1")])
    try:
        ctx = build_context(config, block, None)
        block.add(0, Counter.IN_FLIGHT, 5)  # another worker of this host
        ctx.fleet.attempt_started(0)
        assert list(ctx.fleet.in_flight) == [6, 0]  # what routing balances on
        in_flight, ejected = _engine_state(ctx)
        assert in_flight == {engine_id("e0"): 1, engine_id("e1"): 0}
        assert ejected == {engine_id("e0"): False, engine_id("e1"): False}
        ctx.fleet.attempt_finished(0)
        assert _engine_state(ctx)[0][engine_id("e0")] == 0
    finally:
        block.unlink()
