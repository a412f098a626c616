"""systemd integration: the ``sd_notify`` protocol, without a dependency.

A ``Type=notify`` service tells systemd its state by sending datagrams of ``KEY=value``
lines to the ``AF_UNIX`` ``SOCK_DGRAM`` socket named by ``$NOTIFY_SOCKET`` (an absolute
path, or ``@name`` for the abstract namespace); see ``sd_notify(3)``. fastroute sends:

* ``READY=1`` once the process serves (the proxy: every worker listens; the controller:
  its HTTP API listens and the first control period has finished);
* ``RELOADING=1`` + ``MONOTONIC_USEC=…`` when a SIGHUP reload starts, ``READY=1`` when
  it is done;
* ``STOPPING=1`` when SIGTERM starts the drain (with ``EXTEND_TIMEOUT_USEC=`` covering the
  configured drain, so systemd does not kill a drain the config allows);
* ``STATUS=…`` one-line human status (``systemctl status`` shows it);
* ``WATCHDOG=1`` keep-alives when the unit sets ``WatchdogSec=`` (:meth:`Notifier.keepalive`).

Without ``$NOTIFY_SOCKET`` every call is a no-op returning False, so the same code runs
under systemd, in a terminal and in tests. Sends are non-blocking (a full or missing
receiver costs one failed syscall, never a stall of the event loop); the first failure
is logged as a warning, later ones at debug level, and none is raised to the caller.

:func:`pids_listening` is the proxy supervisor's readiness probe: which worker processes
own a listening TCP socket on the service port (read from ``/proc``, so it needs no
cooperation from the workers).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable

__all__ = [
    "Notifier",
    "monotonic_usec",
    "parse_notify_address",
    "pids_listening",
    "listening_inodes",
]

logger = logging.getLogger(__name__)

#: Environment variables systemd sets for the notify protocol.
_ENV_KEYS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
#: ``/proc/net/tcp*`` state of a listening socket (``TCP_LISTEN``).
_TCP_LISTEN = "0A"
#: Longest STATUS= text sent (systemd shows one line; keep datagrams small).
MAX_STATUS_CHARS = 400


def monotonic_usec() -> int:
    """``CLOCK_MONOTONIC`` in microseconds, as ``MONOTONIC_USEC=`` wants it."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def parse_notify_address(value: str) -> str:
    """The ``sendto`` address of a ``$NOTIFY_SOCKET`` value.

    ``/path`` is a filesystem socket; ``@name`` an abstract one (leading NUL byte).

    Raises
    ------
    ValueError
        Neither form (e.g. systemd's ``vsock:`` addresses, which fastroute does not
        support), or empty.
    """
    if value.startswith("/"):
        return value
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    raise ValueError(f"NOTIFY_SOCKET={value!r}: expected an absolute path or an @abstract name")


class Notifier:
    """Sends ``sd_notify`` messages to one notify socket (or nowhere).

    Parameters
    ----------
    address : str, optional
        The ``$NOTIFY_SOCKET`` value; None (or empty) disables every send.
    watchdog_usec : int, optional
        ``$WATCHDOG_USEC``: the unit's watchdog timeout; :meth:`keepalive` pings at half
        of it. None disables keep-alives.
    """

    def __init__(self, address: str | None, *, watchdog_usec: int | None = None) -> None:
        self._address: str | None = None
        self._sock: socket.socket | None = None
        self._warned = False
        self._status: str | None = None
        self._last_ping_s = float("-inf")
        self.watchdog_interval_s: float | None = (
            watchdog_usec / 2e6 if watchdog_usec and watchdog_usec > 0 else None
        )
        if address:
            try:
                self._address = parse_notify_address(address)
            except ValueError as exc:
                logger.warning("systemd notify disabled: %s", exc)

    @classmethod
    def from_env(cls, *, unset: bool = True) -> Notifier:
        """A notifier for ``$NOTIFY_SOCKET`` (disabled when unset).

        ``unset`` (default) removes the notify variables from the environment, as
        ``sd_notify(unset_environment=1)`` does, so child processes (the proxy's
        workers) neither inherit nor misuse them. The watchdog applies only when
        ``$WATCHDOG_PID`` is unset or names this process.
        """
        env = os.environ
        address = env.get("NOTIFY_SOCKET")
        watchdog_usec: int | None = None
        pid = env.get("WATCHDOG_PID")
        if pid is None or pid == str(os.getpid()):
            try:
                watchdog_usec = int(env.get("WATCHDOG_USEC", ""))
            except ValueError:
                watchdog_usec = None
        if unset:
            for key in _ENV_KEYS:
                env.pop(key, None)
        return cls(address, watchdog_usec=watchdog_usec)

    @property
    def enabled(self) -> bool:
        """Whether messages go anywhere."""
        return self._address is not None

    def notify(self, **fields: str | int) -> bool:
        """Send one datagram of ``KEY=value`` lines; return whether it was sent.

        Values are sent on one line (newlines become spaces). Never raises and never
        blocks: errors are logged (the first as a warning) and return False.
        """
        if self._address is None:
            return False
        text = "".join(
            f"{key}={str(value).replace(chr(10), ' ')}\n" for key, value in fields.items()
        )
        try:
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                sock.setblocking(False)
                self._sock = sock
            self._sock.sendto(text.encode("utf-8", "replace"), self._address)
        except OSError as exc:
            level = logging.DEBUG if self._warned else logging.WARNING
            self._warned = True
            logger.log(level, "systemd notify %s failed: %s", ",".join(fields), exc)
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """``READY=1`` (with ``STATUS=`` when given): startup or a reload finished."""
        if status is None:
            return self.notify(READY=1)
        self._status = status = status[:MAX_STATUS_CHARS]
        return self.notify(READY=1, STATUS=status)

    def reloading(self, status: str = "reloading") -> bool:
        """``RELOADING=1`` with ``MONOTONIC_USEC=`` now: a reload starts."""
        self._status = status = status[:MAX_STATUS_CHARS]
        return self.notify(RELOADING=1, MONOTONIC_USEC=monotonic_usec(), STATUS=status)

    def stopping(self, status: str = "stopping", *, extend_timeout_s: float | None = None) -> bool:
        """``STOPPING=1``: shutdown (the drain) starts.

        ``extend_timeout_s`` also sends ``EXTEND_TIMEOUT_USEC=``, asking systemd for that
        long before it escalates to SIGKILL, whatever the unit's ``TimeoutStopSec=``.
        """
        self._status = status = status[:MAX_STATUS_CHARS]
        if extend_timeout_s is None:
            return self.notify(STOPPING=1, STATUS=status)
        usec = max(1, round(extend_timeout_s * 1e6))
        return self.notify(STOPPING=1, STATUS=status, EXTEND_TIMEOUT_USEC=usec)

    def status(self, text: str) -> bool:
        """``STATUS=text``, sent only when it differs from the last status sent."""
        text = text[:MAX_STATUS_CHARS]
        if text == self._status:
            return False
        self._status = text
        return self.notify(STATUS=text)

    def keepalive(self, now_s: float | None = None) -> bool:
        """``WATCHDOG=1`` if the unit has a watchdog and half its timeout has passed.

        Call it often (every loop tick); it sends at most once per interval.
        """
        if self.watchdog_interval_s is None or self._address is None:
            return False
        now_s = time.monotonic() if now_s is None else now_s
        if now_s - self._last_ping_s < self.watchdog_interval_s:
            return False
        self._last_ping_s = now_s
        return self.notify(WATCHDOG=1)

    async def follow(
        self,
        status: Callable[[], str | None],
        *,
        poll_s: float = 0.05,
        interval_s: float = 1.0,
    ) -> None:
        """Send ``READY=1`` once ``status()`` returns text, then keep ``STATUS=`` current.

        Runs until cancelled: polls ``status`` every ``poll_s`` before readiness and
        every ``interval_s`` after (plus watchdog keep-alives). ``status`` must be
        cheap and must not block: it runs on the event loop.
        """
        if not self.enabled:
            return
        text = status()
        while text is None:
            await asyncio.sleep(poll_s)
            self.keepalive()
            text = status()
        self.ready(text)
        while True:
            await asyncio.sleep(interval_s)
            self.keepalive()
            text = status()
            if text is not None:
                self.status(text)

    def close(self) -> None:
        """Close the socket (sends after this reopen it)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> Notifier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# -- readiness probe ---------------------------------------------------------------------------


def listening_inodes(port: int, proc: str = "/proc") -> set[int] | None:
    """Socket inodes of TCP sockets (IPv4 and IPv6) listening on ``port``, any address.

    None when neither ``/proc/net/tcp`` nor ``/proc/net/tcp6`` is readable (not Linux,
    or a sandbox such as systemd's ``ProcSubset=pid`` hides them).
    """
    inodes: set[int] = set()
    readable = False
    want = f"{port:04X}"
    for table in ("tcp", "tcp6"):
        try:
            with open(f"{proc}/net/{table}", encoding="ascii") as f:
                readable = True
                next(f, None)  # header
                for line in f:
                    fields = line.split()
                    # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
                    if len(fields) < 10 or fields[3] != _TCP_LISTEN:
                        continue
                    if fields[1].rsplit(":", 1)[-1] == want:
                        inodes.add(int(fields[9]))
        except OSError:
            continue  # no IPv6, or no /proc
    return inodes if readable else None


def pids_listening(pids: Iterable[int], port: int, proc: str = "/proc") -> set[int] | None:
    """Those of ``pids`` that hold a TCP socket listening on ``port``.

    None when the probe cannot work here (see :func:`listening_inodes`); processes we
    may not inspect count as not listening. Reads ``/proc/net/tcp*`` once per call:
    callers poll it only until ready.
    """
    pids = list(pids)
    inodes = listening_inodes(port, proc)
    if inodes is None:
        return None
    if not pids or not inodes:
        return set()
    found: set[int] = set()
    for pid in pids:
        fd_dir = f"{proc}/{pid}/fd"
        try:
            names = os.listdir(fd_dir)
        except OSError:
            continue
        for name in names:
            try:
                target = os.readlink(f"{fd_dir}/{name}")
            except OSError:
                continue
            if target.startswith("socket:[") and int(target[8:-1]) in inodes:
                found.add(pid)
                break
    return found
