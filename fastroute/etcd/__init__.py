"""A small etcd v3 client over etcd's JSON gateway (aiohttp), and a leader election on it.

Why the JSON gateway and not a PyPI client: PyPI offers ``aetcd`` 1.0.0 (asyncio, on grpcio
stubs), ``etcd3`` 0.12.0 (synchronous, grpcio) and ``etcd3-py`` 0.1.6 (a 0.1 release); the grpc
ones add grpcio and protobuf to the controller for four calls, the synchronous one would block the
event loop, and none gives a lease-bound election whose epoch we can fence on. The gateway is part
of every etcd 3.4 server, speaks JSON over HTTP and needs only the aiohttp the project already
uses (docs/operations.md "Running several controllers").
"""

from fastroute.etcd.client import EtcdClient, EtcdError, KeyValue
from fastroute.etcd.election import Election, ElectionState, LeaderRecord

__all__ = ["Election", "ElectionState", "EtcdClient", "EtcdError", "KeyValue", "LeaderRecord"]
