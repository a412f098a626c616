"""A real etcd cluster on loopback for tests and the failover benchmark.

:class:`EtcdCluster` starts ``n`` members of Debian's etcd 3.4 (``/usr/bin/etcd``, installed by
``deploy/system_packages.sh``) on free ports with data directories under ``root``, each in its
own session; :meth:`EtcdCluster.kill` SIGKILLs one member, :meth:`EtcdCluster.stop` all.
"""

from __future__ import annotations

import http.client
import shutil
import subprocess
import time
from pathlib import Path

from fastroute.fleetbench.process import free_port, kill_group

__all__ = ["ETCD_MISSING", "START_ATTEMPTS", "EtcdCluster", "etcd_binary"]

#: Cluster starts :meth:`EtcdCluster.start` tries when a member finds its port taken.
START_ATTEMPTS = 3

ETCD_MISSING = (
    "etcd is not installed: run deploy/system_packages.sh (it installs Debian's etcd-server "
    "and etcd-client, /usr/bin/etcd and /usr/bin/etcdctl)"
)


def etcd_binary() -> str:
    """Path of the ``etcd`` binary; raises ``RuntimeError`` naming the install script if absent."""
    path = shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").exists() else None)
    if path is None:
        raise RuntimeError(ETCD_MISSING)
    return path


class _PortTaken(Exception):
    """A member exited because its port was taken (its log's tail is the message)."""


class EtcdCluster:
    """``n`` etcd members on 127.0.0.1 (free ports), data in ``root``.

    Attributes
    ----------
    client_urls : list of str
        Each member's client URL, in member order.
    procs : list of subprocess.Popen or None
        Each member's process (None once killed).
    """

    def __init__(self, root: Path, n: int = 3) -> None:
        self.binary = etcd_binary()
        self.root = root
        self.names = [f"m{i}" for i in range(n)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * n
        self._pick_ports()

    def _pick_ports(self) -> None:
        n = len(self.names)
        self.client_ports = [free_port() for _ in range(n)]
        self.peer_ports = [free_port() for _ in range(n)]
        self.client_urls = [f"http://127.0.0.1:{p}" for p in self.client_ports]

    def _args(self, i: int) -> list[str]:
        cluster = ",".join(
            f"{name}=http://127.0.0.1:{port}"
            for name, port in zip(self.names, self.peer_ports, strict=True)
        )
        peer = f"http://127.0.0.1:{self.peer_ports[i]}"
        return [
            self.binary, "--name", self.names[i], "--data-dir", str(self.root / self.names[i]),
            "--listen-client-urls", self.client_urls[i],
            "--advertise-client-urls", self.client_urls[i],
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", cluster, "--initial-cluster-state", "new",
            "--initial-cluster-token", f"fastroute-{self.peer_ports[0]}",
            # loopback: short heartbeats make an etcd leader change quick in tests
            "--heartbeat-interval", "50", "--election-timeout", "500",
        ]  # fmt: skip

    def start(self, timeout_s: float = 30.0, attempts: int = START_ATTEMPTS) -> EtcdCluster:
        """Start every member and wait until each answers ``/health`` with ``true``.

        A free port can be taken before its member binds it: the members started first
        connect to the others' peer ports from ephemeral ports of the range ``free_port``
        draws from. A member that exits on ``address already in use`` restarts the whole
        cluster on fresh ports and empty data directories (the peer ports are in every
        member's initial cluster), at most ``attempts`` times; any other exit, or no health
        by ``timeout_s``, raises ``RuntimeError`` with the member's log.
        """
        for _ in range(attempts - 1):
            try:
                return self._start_once(timeout_s)
            except _PortTaken:
                self.stop()
                for name in self.names:
                    shutil.rmtree(self.root / name, ignore_errors=True)
                self._pick_ports()
        try:
            return self._start_once(timeout_s)
        except _PortTaken as taken:
            self.stop()
            raise RuntimeError(f"etcd ports taken on all {attempts} attempts:\n{taken}") from None

    def _start_once(self, timeout_s: float) -> EtcdCluster:
        for i in range(len(self.names)):
            self.start_member(i)
        deadline = time.monotonic() + timeout_s
        for i in range(len(self.names)):
            while not self.healthy(i):
                proc = self.procs[i]
                exited = proc is not None and proc.poll() is not None
                if exited or time.monotonic() > deadline:
                    log = (self.root / f"{self.names[i]}.log").read_text()[-2000:]
                    if exited and "address already in use" in log:
                        raise _PortTaken(log)
                    self.stop()
                    raise RuntimeError(f"etcd member {self.names[i]} not healthy:\n{log}")
                time.sleep(0.1)
        return self

    def start_member(self, i: int) -> None:
        """(Re)start member ``i`` on its ports and data directory."""
        with (self.root / f"{self.names[i]}.log").open("ab") as out:
            self.procs[i] = subprocess.Popen(
                self._args(i), stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip

    def healthy(self, i: int) -> bool:
        """Whether member ``i`` answers ``/health`` with ``true``."""
        conn = http.client.HTTPConnection("127.0.0.1", self.client_ports[i], timeout=1.0)
        try:
            conn.request("GET", "/health")
            return b"true" in conn.getresponse().read()
        except OSError:
            return False
        finally:
            conn.close()

    def kill(self, i: int) -> None:
        """SIGKILL member ``i``."""
        proc = self.procs[i]
        if proc is not None:
            kill_group(proc, timeout_s=10.0)
            self.procs[i] = None

    def stop(self) -> None:
        """SIGKILL every member still running."""
        for i in range(len(self.procs)):
            self.kill(i)
