"""A short chaos run on real processes: an engine SIGKILLed and in-stream errors under load.

Every stream the clients read is checked token by token against the output the engines make
for its prompt; the run must end with no corrupt and no unexcused failed request, and the
streams broken by the in-stream errors must have completed by migration.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fastroute.fleetbench.chaos import ChaosOptions, run_chaos

pytestmark = pytest.mark.integration


def test_a_killed_engine_and_in_stream_errors_lose_nothing(tmp_path: Path) -> None:
    options = ChaosOptions(
        duration_s=40.0, seed=3, engines=3, concurrency=4, max_tokens=120,
        kinds=("engine_sigkill", "stream_errors"), warmup_s=3.0, gap_s=2.0,
    )  # fmt: skip
    summary = asyncio.run(run_chaos(options, tmp_path))
    assert [f["kind"] for f in summary["faults"]] in (
        ["engine_sigkill", "stream_errors"], ["stream_errors", "engine_sigkill"],
    )  # fmt: skip
    assert summary["corrupt"] == 0, summary["reasons"]
    assert summary["unexcused_failures"] == 0, summary["reasons"]
    assert summary["table"]["stream_errors"].get("migrated", 0) >= 1, summary["table"]
    assert summary["verdict"] == "pass"
    assert (tmp_path / "results.md").read_text().count("|") > 10
