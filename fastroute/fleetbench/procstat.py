"""CPU time and memory of a process tree, read from ``/proc`` (Linux).

A managed server runs in its own session (:mod:`fastroute.fleetbench.process`), so "the
router" is every live process whose session id is the leader's pid: a supervisor
and its workers, or a Rust binary and its threads.

* :func:`session_cpu_s` — utime + stime of every live member, plus cutime + cstime
  (children it already reaped), seconds;
* :func:`session_rss_bytes` — Σ resident set size of the live members;
* :class:`RssSampler` — the peak of that sum, sampled every ``interval_s`` in a
  background thread (reading ``/proc`` never runs on the event loop).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

__all__ = ["session_cpu_s", "session_rss_bytes", "session_pids", "RssSampler"]

_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _stat_fields(pid: str) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The command name may contain spaces and ')': split after the last ')'.
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _stats() -> Iterator[tuple[int, list[str]]]:
    """``(pid, stat fields after the command name)`` of every process still there."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(entry)
            if fields is not None:
                yield int(entry), fields


def session_pids(sid: int) -> list[int]:
    """Pids of the live (not zombie) processes of session ``sid``."""
    # stat field 3: state ("Z" = exited, not yet reaped); field 6: session
    return [pid for pid, f in _stats() if int(f[3]) == sid and f[0] != "Z"]


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` has a live (not zombie) member (stat field 5)."""
    return any(int(f[2]) == pgid and f[0] != "Z" for _, f in _stats())


def session_cpu_s(sid: int) -> float:
    """CPU seconds used by session ``sid``: live members plus the children they reaped."""
    # utime, stime, cutime, cstime are stat fields 14-17.
    ticks = sum(
        int(f[11]) + int(f[12]) + int(f[13]) + int(f[14]) for _, f in _stats() if int(f[3]) == sid
    )
    return ticks / _CLK_TCK


def session_rss_bytes(sid: int) -> int:
    """Σ resident memory of the live members of session ``sid``, bytes."""
    total = 0
    for pid in session_pids(sid):
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * _PAGE
        except (OSError, IndexError, ValueError):
            continue
    return total


class RssSampler:
    """Samples :func:`session_rss_bytes` in a daemon thread; :attr:`peak_bytes` is the max.

    Parameters
    ----------
    sid : int
        The session (the managed process's pid).
    interval_s : float
        Sampling period.
    """

    def __init__(self, sid: int, interval_s: float = 0.5) -> None:
        self.sid = sid
        self.interval_s = interval_s
        self.peak_bytes = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"rss-{sid}", daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def sample(self) -> int:
        """Take one sample now; return it."""
        rss = session_rss_bytes(self.sid)
        self.peak_bytes = max(self.peak_bytes, rss)
        self.samples += 1
        return rss

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
