"""Process groups, death detection and /proc accounting of the harness (real processes)."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from fastroute.fleetbench.process import ProcessDiedError, ProcessSet, free_port, wait_http_ok
from fastroute.fleetbench.procstat import RssSampler, session_cpu_s, session_pids
from fastroute.fleetbench.stack import remove_segments
from fastroute.tables.segment import shm_dir

pytestmark = pytest.mark.integration

# A parent that ignores SIGTERM and has a child that ignores it too: only SIGKILL works.
STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print("child", child.pid, flush=True)
time.sleep(600)
"""


def _wait(predicate, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_stop_kills_the_whole_group_after_the_bound(tmp_path: Path) -> None:
    with ProcessSet(tmp_path) as procs:
        proc = procs.start("stubborn", [sys.executable, "-c", STUBBORN])
        _wait(lambda: "child" in proc.log_tail())
        child = int(proc.log_tail().split()[1])
        assert set(session_pids(proc.pid)) >= {proc.pid, child}
        t0 = time.monotonic()
        procs.stop(proc, timeout_s=0.5)
        assert time.monotonic() - t0 < 5.0
    _wait(lambda: session_pids(proc.pid) == [])  # SIGKILL delivery is asynchronous
    assert not procs.processes


def test_a_dead_process_is_reported_with_its_log(tmp_path: Path) -> None:
    with ProcessSet(tmp_path) as procs:
        proc = procs.start("dies", [sys.executable, "-c", "print('bye'); raise SystemExit(4)"])
        _wait(lambda: not proc.alive())
        with pytest.raises(ProcessDiedError, match=r"dies exited with status 4(.|\n)*bye"):
            procs.check_alive()


def test_wait_http_ok_fails_fast_when_the_server_dies(tmp_path: Path) -> None:
    with ProcessSet(tmp_path) as procs:
        proc = procs.start("nothing", [sys.executable, "-c", "raise SystemExit(1)"])
        url = f"http://127.0.0.1:{free_port()}/health"
        with pytest.raises(ProcessDiedError):
            asyncio.run(wait_http_ok(url, timeout_s=30.0, process=proc))
        with pytest.raises(TimeoutError, match="not ready within 0.3 s"):
            asyncio.run(wait_http_ok(url, timeout_s=0.3))


def test_cpu_and_rss_of_a_busy_session(tmp_path: Path) -> None:
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    spin += "x = bytearray(64 << 20)\nprint('done', flush=True)\ntime.sleep(600)\n"
    with ProcessSet(tmp_path) as procs:
        proc = procs.start("busy", [sys.executable, "-c", spin])
        with RssSampler(proc.pid, interval_s=0.05) as sampler:
            _wait(lambda: "done" in proc.log_tail())
            sampler.sample()
        assert session_cpu_s(proc.pid) >= 0.3
        assert sampler.peak_bytes >= 64 << 20


def test_remove_segments_removes_only_the_run_prefix() -> None:
    base = shm_dir()
    mine = base / "fastroute-test-abcdef12-weights"
    other = base / "fastroute-test-00000000-weights"
    mine.write_bytes(b"x")
    other.write_bytes(b"x")
    try:
        assert remove_segments("fastroute-test-abcdef12") == [mine.name]
        assert other.exists() and not mine.exists()
        with pytest.raises(ValueError, match="broad prefix"):
            remove_segments("fastroute-")
    finally:
        other.unlink(missing_ok=True)
        mine.unlink(missing_ok=True)
