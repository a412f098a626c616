"""Real ``fastroute`` processes for integration tests: started, found ready, always killed.

Every process runs in its own session (``start_new_session``), so one ``killpg`` stops it and
all it started (a proxy supervisor and its workers). :func:`start_engines` reads the
``engine NAME listening on URL`` lines ``fastroute engine`` prints once each engine serves.
Helpers that wait fail after a bound (:data:`START_TIMEOUT_S`) instead of hanging the test.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from fastroute.fleetbench.process import free_port, kill_group

__all__ = [
    "START_TIMEOUT_S",
    "child_env",
    "free_port",
    "http_get",
    "http_metric",
    "kill_groups",
    "processes_naming",
    "start_engines",
    "start_fastroute",
]

#: Bound on a process becoming ready, seconds.
START_TIMEOUT_S = 30.0

_ENGINE_READY = re.compile(r"^engine (\S+) listening on (http://127\.0\.0\.1:\d+)$")


def child_env(shm_dir: Path, **extra: str) -> dict[str, str]:
    """This environment for a child: unbuffered output, the shared-memory directory
    ``shm_dir``, no inherited systemd notify or watchdog variables, then ``extra``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FASTROUTE_SHM_DIR": str(shm_dir)}
    for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        env.pop(key, None)
    return env | extra


def start_fastroute(
    args: Sequence[str], env: Mapping[str, str], log: Path, *, log_level: str = "WARNING"
) -> subprocess.Popen[bytes]:
    """``python -m fastroute ARGS`` in its own session, stdout and stderr appended to ``log``."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "fastroute", "--log-level", log_level, *args],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=dict(env), start_new_session=True,
        )  # fmt: skip


def start_engines(
    n: int, env: Mapping[str, str], *, model: str, profile: str = "h100"
) -> tuple[subprocess.Popen[bytes], list[str]]:
    """``fastroute engine --count n`` on free ports; the process and the engines' URLs, once
    each engine listens.

    Raises
    ------
    AssertionError
        The process exited, or not every engine listened within :data:`START_TIMEOUT_S`.
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastroute", "--log-level", "WARNING", "engine", "--count", str(n),
         "--base-port", "0", "--profile", profile, "--model", model],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        env=dict(env), start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    urls: list[str] = []
    deadline = time.monotonic() + START_TIMEOUT_S
    while len(urls) < n:  # one "listening" line per engine, then the engines serve
        assert time.monotonic() < deadline, "engines did not start"
        line = proc.stdout.readline().decode().strip()
        assert line or proc.poll() is None, "fastroute engine exited early"
        match = _ENGINE_READY.match(line)
        if match:
            urls.append(match.group(2))
    return proc, urls


def kill_groups(procs: Iterable[subprocess.Popen[bytes]]) -> None:
    """SIGKILL each process's group (its session), reap it and close its pipes."""
    for proc in procs:
        kill_group(proc, timeout_s=10.0)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):  # unflushed stdin of a dead process
                    stream.close()


def http_get(port: int, path: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    """``GET path`` on ``127.0.0.1:port`` over a fresh connection; ``(0, b"")`` if refused."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    except OSError:
        return 0, b""
    finally:
        conn.close()


def http_metric(port: int, sample: str) -> float | None:
    """The value of ``sample`` on the server's ``/metrics``: a name (its first series) or a
    name with labels (``name{label="x"}``, that series); None if absent or unreachable."""
    status, body = http_get(port, "/metrics")
    if status != 200:
        return None
    for line in body.decode().splitlines():
        if line.startswith((sample + " ", sample + "{")):
            return float(line.rsplit(" ", 1)[1])
    return None


def processes_naming(text: str) -> list[str]:
    """``"PID: command line"`` of every process but this one whose command line has ``text``
    (what a run left behind)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue  # exited meanwhile
        if text.encode() in cmdline:
            found.append(f"{entry}: {cmdline.decode(errors='replace')}")
    return found
