"""Child processes of the demo, the benchmarks and the tests: started, watched, always stopped.

The one home of process control: :class:`ManagedProcess` / :class:`ProcessSet` for the
demo and the fleet benchmark; :func:`stop_group`, :func:`kill_group`, :func:`free_port`
and :func:`wait_http_ok` also for the processes ``fastroute.testing`` and
``bench/bench_proxy.py`` start themselves.

Every server runs in its **own session** (``start_new_session``): its whole process
tree (a proxy supervisor and its workers, nginx and its workers) is one process
group, measured together (:mod:`fastroute.fleetbench.procstat`) and stopped together —
SIGTERM to the group, SIGKILL to the group after a bound. Children also get
``PR_SET_PDEATHSIG = SIGTERM``, so a harness killed with SIGKILL does not leave
them running. Start processes from the main thread: the death signal follows the
thread that forked.

Output (stdout and stderr) goes to ``LOG_DIR/NAME.log``; :meth:`ManagedProcess.log_tail`
quotes it in error messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from fastroute.fleetbench.procstat import group_alive

__all__ = [
    "ManagedProcess",
    "ProcessSet",
    "ProcessDiedError",
    "Watched",
    "free_port",
    "kill_group",
    "stop_group",
    "wait_http_ok",
    "TERM_TIMEOUT_S",
]

#: Seconds a process group gets between SIGTERM and SIGKILL.
TERM_TIMEOUT_S = 10.0


class ProcessDiedError(RuntimeError):
    """A managed process exited while it was expected to run."""


class Watched(Protocol):
    """A process :func:`wait_http_ok` watches while it waits (a :class:`ManagedProcess`)."""

    name: str

    def check_alive(self) -> None:
        """Raise :class:`ProcessDiedError` if the process exited."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on ``host`` (the caller's server binds it a moment later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


_PR_SET_PDEATHSIG = 1


def _death_signal_setter() -> Callable[[], None] | None:
    """A callable for ``preexec_fn`` that sets the death signal (resolved before the fork)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def setup() -> None:  # runs in the child between fork and exec: no imports, no locks
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)

    return setup


class ManagedProcess:
    """One child process in its own session, logging to a file.

    Parameters
    ----------
    name : str
        Short name (log file, messages).
    cmd : sequence of str
        The command line.
    log_dir : Path
        Where ``NAME.log`` is written.
    env : mapping, optional
        Extra environment variables (added to this process's environment).
    """

    def __init__(
        self,
        name: str,
        cmd: Sequence[str],
        *,
        log_dir: Path,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.cmd = list(cmd)
        self.log_path = Path(log_dir) / f"{name}.log"
        full_env = dict(os.environ)
        if env:
            full_env.update(env)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=full_env,
                preexec_fn=_death_signal_setter(),
            )
        self.started_at = time.monotonic()

    @property
    def pid(self) -> int:
        """The leader's pid (also the session and process-group id)."""
        return self.proc.pid

    def alive(self) -> bool:
        """True while the leader runs."""
        return self.proc.poll() is None

    def log_tail(self, max_chars: int = 2000) -> str:
        """The end of the process's output."""
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-max_chars:].decode(errors="replace")

    def check_alive(self) -> None:
        """Raise :class:`ProcessDiedError` (with the log's end) if the leader exited."""
        code = self.proc.poll()
        if code is not None:
            raise ProcessDiedError(
                f"{self.name} exited with status {code}; its log ends:\n{self.log_tail()}"
            )

    def stop(self, timeout_s: float = TERM_TIMEOUT_S) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``timeout_s``; return the exit status."""
        return stop_group(self.proc, timeout_s)


def stop_group(proc: subprocess.Popen[bytes], timeout_s: float = TERM_TIMEOUT_S) -> int | None:
    """SIGTERM the process group of ``proc`` (a session leader), SIGKILL it after ``timeout_s``.

    Returns
    -------
    int or None
        The leader's exit status (None if it could not be reaped).
    """
    pgid = proc.pid
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout_s)
    # The leader may have exited while members of its group linger (workers): kill them.
    if _group_alive(pgid):
        deadline = time.monotonic() + timeout_s
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout_s)
    return proc.returncode


def kill_group(proc: subprocess.Popen[bytes], timeout_s: float = TERM_TIMEOUT_S) -> int | None:
    """SIGKILL the process group of ``proc`` (a session leader) at once and reap the leader."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout_s)
    return proc.returncode


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg succeeds for zombies too: look for a live, non-zombie member.
    return group_alive(pgid)


class ProcessSet:
    """The processes of one run, stopped in reverse start order (a context manager).

    Parameters
    ----------
    log_dir : Path
        Log directory of every process.
    """

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.processes: list[ManagedProcess] = []

    def start(
        self, name: str, cmd: Sequence[str], *, env: Mapping[str, str] | None = None
    ) -> ManagedProcess:
        """Start and register a process."""
        proc = ManagedProcess(name, cmd, log_dir=self.log_dir, env=env)
        self.processes.append(proc)
        return proc

    def check_alive(self) -> None:
        """Raise :class:`ProcessDiedError` for the first registered process that exited."""
        for proc in self.processes:
            proc.check_alive()

    def stop(self, proc: ManagedProcess, timeout_s: float = TERM_TIMEOUT_S) -> int | None:
        """Stop one process and forget it."""
        code = proc.stop(timeout_s)
        if proc in self.processes:
            self.processes.remove(proc)
        return code

    def stop_all(self, timeout_s: float = TERM_TIMEOUT_S) -> None:
        """Stop every process, newest first."""
        while self.processes:
            self.stop(self.processes[-1], timeout_s)

    def __enter__(self) -> ProcessSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


async def wait_http_ok(
    url: str,
    *,
    timeout_s: float = 30.0,
    process: Watched | None = None,
    interval_s: float = 0.1,
    json_body: Any = None,
) -> None:
    """Poll ``GET url`` (``POST`` of ``json_body`` when given) until it answers 200.

    Raises
    ------
    ProcessDiedError
        ``process`` exited meanwhile.
    TimeoutError
        No 200 within ``timeout_s``; the message names the URL and the last outcome.
    """
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    timeout = aiohttp.ClientTimeout(total=2.0)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        while True:
            if process is not None:
                process.check_alive()
            try:
                request = http.get(url) if json_body is None else http.post(url, json=json_body)
                async with request as resp:
                    await resp.read()
                    if resp.status == 200:
                        return
                    last = f"HTTP {resp.status}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                where = f" ({process.name})" if process is not None else ""
                raise TimeoutError(f"{url}{where} not ready within {timeout_s} s: {last}")
            await asyncio.sleep(interval_s)
