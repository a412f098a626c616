"""Hosts on one machine: a network namespace per host, joined by one bridge, for multi-host tests.

Each :class:`Host` is a network namespace with one interface (``eth0``) and one address in
``10.213.0.0/24``; the bridge that joins them lives in a namespace of its own (the *fabric*), so
nothing is added to the machine's own network: every address exists only inside namespaces the
:class:`Topology` made, and :meth:`Topology.close` deletes them all (which deletes their
interfaces). Processes started with :meth:`Host.popen` run inside their host's namespace, so a
request from one host to another crosses a real socket, a veth pair and the bridge: a process
that binds its host's address cannot be reached through ``127.0.0.1`` from any other host.

Each namespace has its own port space, so a server inside one may use a fixed port without
colliding with anything on the machine or in another test; the addresses of two topologies
may be equal for the same reason.

Needs root (``CAP_SYS_ADMIN`` and ``CAP_NET_ADMIN``) and iproute2's ``ip``;
:func:`netns_unavailable` says why a machine cannot run it, for a ``pytest.skip`` reason.
Traffic shaping (``tc netem``) is not used: the machine's kernel may lack the module.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fastroute.fleetbench.process import kill_group

__all__ = ["SUBNET_PREFIX", "Host", "Topology", "env_without_proxies", "netns_unavailable"]

#: The hosts' addresses are ``SUBNET_PREFIX.{1..250}`` (a /24 inside the topology's namespaces).
SUBNET_PREFIX = "10.213.0"

#: Bound on one ``ip`` command, seconds (they return in milliseconds; a hang is a broken host).
IP_TIMEOUT_S = 10.0

#: Most hosts in one topology: the /24 minus the network, broadcast and a few spares.
MAX_HOSTS = 250


def _ip(*args: str, netns: str | None = None) -> None:
    """Run ``ip ARGS`` (inside ``netns`` when given); raise with ip's own message on failure."""
    argv = ["ip", *(("-n", netns) if netns else ()), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise OSError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")


def netns_unavailable() -> str | None:
    """Why this machine cannot build a :class:`Topology`, or None if it can.

    Tries the real thing (adds and deletes a namespace) rather than guessing from the user id:
    a container may be root without ``CAP_SYS_ADMIN``.
    """
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (Debian package iproute2)"
    probe = f"frprobe-{uuid.uuid4().hex[:8]}"
    try:
        _ip("netns", "add", probe)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"network namespaces are not permitted here (needs root with CAP_SYS_ADMIN): {exc}"
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        _ip("netns", "del", probe)
    return None


@dataclass
class Host:
    """One host of a :class:`Topology`: a network namespace with one address.

    Attributes
    ----------
    name : str
        The host's name in the test (e.g. ``"east"``).
    netns : str
        The namespace's name (``ip netns exec NETNS …``).
    address : str
        Its IPv4 address, reachable from every other host of the topology.
    """

    name: str
    netns: str
    address: str
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list, repr=False)

    def url(self, port: int) -> str:
        """``http://ADDRESS:PORT`` of a server this host runs."""
        return f"http://{self.address}:{port}"

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def popen(
        self, argv: Sequence[str], *, env: Mapping[str, str], log: Path
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside the host in its own session, output appended to ``log``.

        The process is killed (with its session) by :meth:`Topology.close`; ``ip netns exec``
        execs the command, so the returned process is the command itself.
        """
        with log.open("ab") as out:
            proc = subprocess.Popen(
                self.argv(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=dict(env), start_new_session=True,
            )  # fmt: skip
        self._procs.append(proc)
        return proc

    def run(
        self, argv: Sequence[str], *, env: Mapping[str, str], timeout_s: float
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the host; wait at most ``timeout_s``; its output as text."""
        return subprocess.run(
            self.argv(argv), capture_output=True, text=True, env=dict(env), timeout=timeout_s,
            check=False,
        )  # fmt: skip

    def kill_all(self) -> None:
        """SIGKILL every process this host started (and what they started)."""
        for proc in self._procs:
            kill_group(proc, timeout_s=10.0)
        self._procs.clear()


class Topology:
    """Hosts in network namespaces on one bridge; a context manager that removes them all.

    Parameters
    ----------
    tag : str, optional
        Prefix of the namespace names (default ``fr`` + a random suffix, so concurrent
        topologies never share a name).
    """

    def __init__(self, tag: str | None = None) -> None:
        self.tag = tag or f"fr{uuid.uuid4().hex[:6]}"
        self.fabric = f"{self.tag}-fabric"
        self.hosts: dict[str, Host] = {}
        _ip("netns", "add", self.fabric)
        try:
            _ip("link", "set", "lo", "up", netns=self.fabric)
            _ip("link", "add", "br0", "type", "bridge", netns=self.fabric)
            _ip("link", "set", "br0", "up", netns=self.fabric)
        except BaseException:
            self.close()
            raise

    def add_host(self, name: str) -> Host:
        """A new host ``name``: its namespace, a veth pair to the bridge, the next address.

        Raises
        ------
        ValueError
            ``name`` is taken, or the topology already has :data:`MAX_HOSTS` hosts.
        """
        if name in self.hosts:
            raise ValueError(f"host {name!r} exists already")
        if len(self.hosts) >= MAX_HOSTS:
            raise ValueError(f"a topology holds at most {MAX_HOSTS} hosts")
        index = len(self.hosts) + 1
        host = Host(name, f"{self.tag}-{name}", f"{SUBNET_PREFIX}.{index}")
        _ip("netns", "add", host.netns)
        self.hosts[name] = host  # from here on close() removes it
        port = f"p{index}"  # the bridge side, in the fabric namespace (names ≤ 15 bytes)
        _ip("link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", host.netns,
            netns=self.fabric)  # fmt: skip
        _ip("link", "set", port, "master", "br0", "up", netns=self.fabric)
        _ip("addr", "add", f"{host.address}/24", "dev", "eth0", netns=host.netns)
        _ip("link", "set", "eth0", "up", netns=host.netns)
        _ip("link", "set", "lo", "up", netns=host.netns)
        return host

    def close(self) -> None:
        """Kill every host's processes, then delete the hosts' and the fabric's namespaces."""
        for host in self.hosts.values():
            host.kill_all()
        for netns in [h.netns for h in self.hosts.values()] + [self.fabric]:
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                _ip("netns", "del", netns)
        self.hosts.clear()

    def __enter__(self) -> Topology:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def env_without_proxies(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default this process's environment) without HTTP proxy variables, which
    would send a host's requests to a proxy no namespace can reach."""
    env = dict(os.environ if base is None else base)
    for key in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        env.pop(key, None)
    return env
