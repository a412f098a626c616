"""``fastroute demo`` end to end: real processes on loopback, then nothing left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from fastroute.tables.segment import shm_dir
from fastroute.testing.processes import processes_naming

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ENGINES = [f"{g}-{i}" for g in ("h100-llama", "h100-mistral", "a40-llama", "a40-mistral")
           for i in (0, 1)]  # fmt: skip


def _start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "fastroute", "demo", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a SIGINT sent to the test's group must not reach it
    )


def _run_prefix(line: str) -> str:
    match = re.search(r"run (fastroute-demo-[0-9a-f]{8})", line)
    assert match, line
    return match.group(1)


def _leftovers(prefix: str) -> tuple[list[str], list[str]]:
    """Processes whose command line names the run, and the run's shared-memory files."""
    return processes_naming(prefix), [p.name for p in shm_dir().glob(prefix + "*")]


def _check_summary(out: str) -> None:
    assert "Summary:" in out, out
    for name in ENGINES:
        assert re.search(rf"^{name}\s", out, re.M), f"{name} missing from the table:\n{out}"
    match = re.search(r"^requests\s+(\d+) sent, (\d+) ok", out, re.M)
    assert match, out
    assert int(match.group(2)) > 0
    assert re.search(r"^goodput\s+[\d.]+ req/s within SLO", out, re.M), out
    assert re.search(r"^proxies\s+\d+ retries, \d+ requests shed", out, re.M), out
    assert "/plan (HTML)" in out and "/metrics" in out


def test_demo_runs_prints_the_summary_and_leaves_nothing() -> None:
    """A 15 s demo (one engine slowed halfway) exits 0, prints the table, leaves nothing."""
    proc = _start("--duration", "15", "--fault", "slow")
    try:
        out, _ = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out
    _check_summary(out)
    prefix = _run_prefix(out.splitlines()[0])
    assert f"removed shared memory: {prefix}-weights" in out  # the controller's table too
    assert re.search(r"^fault\s+slow \(\{'slowdown': 3.0\}\) on h100-llama-0 from t=8 s", out, re.M)
    assert _leftovers(prefix) == ([], []), out


def test_sigint_halfway_stops_early_prints_and_cleans_up() -> None:
    """Ctrl-C while traffic runs: the summary still prints, exit 0, nothing left behind."""
    proc = _start("--duration", "60")
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 60
    try:
        for line in proc.stdout:  # bounded: the demo prints a progress line every 5 s
            lines.append(line)
            if line.strip().startswith("t=") or time.monotonic() > deadline:
                break
        assert any(x.strip().startswith("t=") for x in lines), "".join(lines)
        prefix = _run_prefix(lines[0])
        procs, segments = _leftovers(prefix)
        assert len(procs) >= 4 and segments  # fleet, controller, two proxies (+ workers)
        os.kill(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = "".join(lines) + rest
    assert proc.returncode == 0, out
    assert "(stopped early)" in out
    _check_summary(out)
    assert _leftovers(prefix) == ([], []), out
