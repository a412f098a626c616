"""The test cluster itself: a member whose port is taken before it binds restarts the cluster
on fresh ports (``EtcdCluster.start``), instead of failing the test that wanted etcd."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from fastroute.testing.etcd import EtcdCluster


def _hold(port: int) -> socket.socket:
    """A listening socket on ``127.0.0.1:port``: the port is taken until it is closed."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_a_taken_port_restarts_the_cluster_on_fresh_ports(tmp_path: Path) -> None:
    cluster = EtcdCluster(tmp_path / "etcd", n=3)
    cluster.root.mkdir()
    taken = cluster.client_ports[2]
    with _hold(taken):
        try:
            cluster.start()
            assert taken not in cluster.client_ports
            assert all(cluster.healthy(i) for i in range(3))
            log = (cluster.root / "m2.log").read_text()
            assert "address already in use" in log  # the first start did collide
        finally:
            cluster.stop()


def test_ports_taken_on_every_attempt_fail_with_the_members_log(tmp_path: Path) -> None:
    cluster = EtcdCluster(tmp_path / "etcd", n=3)
    cluster.root.mkdir()
    with _hold(cluster.peer_ports[1]):
        try:
            with pytest.raises(RuntimeError, match="etcd ports taken on all 1 attempts"):
                cluster.start(attempts=1)
        finally:
            cluster.stop()
    assert all(proc is None for proc in cluster.procs)
