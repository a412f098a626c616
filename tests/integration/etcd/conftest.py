"""A real 3-member etcd cluster on loopback, per test (free ports, data under tmp_path)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fastroute.testing.etcd import EtcdCluster


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    """Three etcd members; fails (no skip) naming the install script if etcd is absent."""
    cluster = EtcdCluster(tmp_path / "etcd", n=3)
    cluster.root.mkdir()
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
