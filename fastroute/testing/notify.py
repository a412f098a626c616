"""The service manager's side of systemd's ``NOTIFY_SOCKET``, for tests of ``sd_notify``."""

from __future__ import annotations

import socket
import struct
import subprocess
import time
from pathlib import Path

__all__ = ["NotifyReceiver"]

_UCRED = struct.Struct("3i")  # pid, uid, gid


class NotifyReceiver:
    """A datagram socket receiving notify messages with the sender's pid (``SO_PASSCRED``).

    Parameters
    ----------
    address : str
        A filesystem path, or ``"\\0name"`` for the abstract socket a child reaches as
        ``NOTIFY_SOCKET=@name``.
    timeout_s : float
        Bound on :meth:`expect`.

    Attributes
    ----------
    seen : list of (int, dict)
        Every message received: the sender's pid and its ``KEY=value`` fields.
    """

    def __init__(self, address: str, timeout_s: float = 30.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self.sock.bind(address)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        except OSError:
            self.sock.close()
            raise
        self.timeout_s = timeout_s
        self.seen: list[tuple[int, dict[str, str]]] = []

    def expect(
        self, key: str, sender: subprocess.Popen[bytes], log: Path
    ) -> tuple[int, dict[str, str]]:
        """The next message carrying ``key`` (earlier ones are kept in :attr:`seen`).

        Raises
        ------
        AssertionError
            No such message within ``timeout_s``, or ``sender`` exited first (with the end of
            its ``log``), or a message does not end with a newline.
        """
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {key}= within {self.timeout_s} s; got {self.seen}")
            self.sock.settimeout(min(left, 0.2))
            try:
                data, ancdata, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(_UCRED.size))
            except TimeoutError:  # nothing queued: fail now if the sender is gone
                if sender.poll() is not None:
                    raise AssertionError(
                        f"exited {sender.returncode} before {key}=:\n{log.read_text()[-3000:]}"
                    ) from None
                continue
            pid = next(
                _UCRED.unpack(d[: _UCRED.size])[0]
                for level, kind, d in ancdata
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS
            )
            text = data.decode()
            assert text.endswith("\n"), text
            fields = dict(line.split("=", 1) for line in text.splitlines())
            self.seen.append((pid, fields))
            if key in fields:
                return pid, fields

    def close(self) -> None:
        """Close the socket (an abstract address is released at once)."""
        self.sock.close()
