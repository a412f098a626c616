"""``fastroute sim run`` / ``compare`` as a real subprocess: outputs on disk, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCENARIO = """
name = "cli-tiny"
description = "Two engines, light chat, 20 s."
duration_s = 20
drain_s = 30
[[engines]]
name = "h100"
count = 2
capacity_rps = 10
[workload]
rate_sessions_per_s = 1.0
mean_turns = 2
think_time_s = 1
[control]
optimiser = "static"
[[variants]]
name = "budget"
set = { "dataplane.retry" = "budget" }
[[variants]]
name = "fixed"
set = { "dataplane.retry" = "fixed", "dataplane.max_attempts" = 3 }
"""


def _sim(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fastroute", "sim", *args],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )


def test_run_writes_report_metrics_and_plots(tmp_path: Path):
    """run: exit 0, metrics.json with the documented sections, report.md, PNG plots."""
    scenario = tmp_path / "s.toml"
    scenario.write_text(SCENARIO)
    out = tmp_path / "out"
    proc = _sim("run", str(scenario), "--policy", "round-robin", "--seed", "3", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["policy"] == "round-robin" and metrics["seed"] == 3
    assert {"summary", "fleet", "control", "sim"} <= set(metrics)
    assert metrics["summary"]["overall"]["requests"] > 0
    report = (out / "report.md").read_text()
    assert "round-robin" in report and "TTFT p99" in report
    pytest.importorskip("matplotlib")
    assert (out / "weights.png").stat().st_size > 0 and (out / "ttft.png").stat().st_size > 0


def test_compare_runs_every_variant_and_policy(tmp_path: Path):
    """compare: one arm per (variant, policy), a comparison report, same metrics per seed."""
    scenario = tmp_path / "s.toml"
    scenario.write_text(SCENARIO)
    out = tmp_path / "cmp"
    proc = _sim(
        "compare",
        str(scenario),
        "--policies",
        "least-request,consistent-hash",
        "--out",
        str(out),
        "--quiet",
    )
    assert proc.returncode == 0, proc.stderr
    arms = json.loads((out / "metrics.json").read_text())
    assert set(arms) == {
        "budget+least-request",
        "budget+consistent-hash",
        "fixed+least-request",
        "fixed+consistent-hash",
    }
    assert "budget+least-request" in (out / "report.md").read_text()
    # Same seed, same arm settings -> same simulated metrics.
    again = tmp_path / "again"
    proc = _sim(
        "run",
        str(scenario),
        "--policy",
        "least-request",
        "--set",
        "dataplane.retry=budget",
        "--out",
        str(again),
        "--quiet",
    )
    assert proc.returncode == 0, proc.stderr
    rerun = json.loads((again / "metrics.json").read_text())
    assert rerun["summary"] == arms["budget+least-request"]["summary"]


def test_bad_input_is_a_clear_error(tmp_path: Path):
    """Unknown policy or a broken scenario: exit 2 and a one-line reason on stderr."""
    scenario = tmp_path / "s.toml"
    scenario.write_text(SCENARIO)
    proc = _sim("run", str(scenario), "--policy", "nope", "--out", str(tmp_path / "o"), "--quiet")
    assert proc.returncode == 2 and "unknown routing policy 'nope'" in proc.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("[[engines]]\nname = 'e'\nprofile = 'tpu'\n")
    proc = _sim("run", str(bad), "--out", str(tmp_path / "o2"), "--quiet")
    assert proc.returncode == 2 and "unknown profile" in proc.stderr
