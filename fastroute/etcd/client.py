"""etcd v3 over its JSON gateway: leases, put/range/delete and the create-if-absent transaction.

Every call is one ``POST /v3/...`` with a bounded total timeout, tried on each endpoint of the URL
list in turn starting from the last one that answered (endpoint failover); keys and values are
base64 on the wire and ``bytes``/``str`` here. An error after all endpoints were tried is an
:class:`EtcdError` naming each endpoint's failure.
"""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass
from typing import Any

import aiohttp

from fastroute.errors import FastrouteError

__all__ = ["EtcdClient", "EtcdError", "KeyValue"]


class EtcdError(FastrouteError):
    """No etcd endpoint answered the call, or etcd refused it."""


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key as etcd returned it: value, the revision that created it, its lease (0: none)."""

    key: str
    value: str
    create_revision: int
    mod_revision: int
    lease: int


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode()


def _kv(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(
        key=_unb64(raw["key"]),
        value=_unb64(raw.get("value", "")),
        create_revision=int(raw.get("create_revision", 0)),
        mod_revision=int(raw.get("mod_revision", 0)),
        lease=int(raw.get("lease", 0)),
    )


class EtcdClient:
    """The few etcd v3 calls the controllers' election needs.

    Parameters
    ----------
    urls : sequence of str
        Client URLs of the cluster's members (``http://host:2379``); at least one.
    timeout_s : float
        Total timeout of one call on one endpoint, seconds. A call tries every endpoint, so it
        takes at most ``len(urls) * timeout_s``.
    """

    def __init__(self, urls: list[str] | tuple[str, ...], timeout_s: float = 1.0) -> None:
        cleaned = [u.strip().rstrip("/") for u in urls if u.strip()]
        if not cleaned:
            raise EtcdError("no etcd URL given")
        for u in cleaned:
            if not u.startswith(("http://", "https://")):
                raise EtcdError(f"etcd URL must start with http:// or https://, got {u!r}")
        if not timeout_s > 0:
            raise EtcdError(f"etcd timeout_s must be > 0, got {timeout_s}")
        self.urls = cleaned
        self.timeout_s = timeout_s
        self._preferred = 0
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        """Close the HTTP session (the client may be used again afterwards)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<path>`` on the first endpoint that answers; its JSON reply.

        Raises
        ------
        EtcdError
            Every endpoint failed (connection, timeout, HTTP error or an etcd error body).
        """
        if self._session is None:
            self._session = aiohttp.ClientSession()
        failures: list[str] = []
        n = len(self.urls)
        for i in range(n):
            index = (self._preferred + i) % n
            url = f"{self.urls[index]}/v3/{path}"
            try:
                reply = await self._post(url, body)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                failures.append(f"{self.urls[index]}: {type(exc).__name__}: {exc}")
                continue
            self._preferred = index
            return reply
        raise EtcdError(f"etcd /v3/{path} failed on every endpoint: " + "; ".join(failures))

    async def _post(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with self._session.post(url, json=body, timeout=timeout) as resp:
            reply = await resp.json(content_type=None)
        if not isinstance(reply, dict):
            raise ValueError(f"etcd answered {type(reply).__name__}, not an object")
        if "error" in reply and "result" not in reply:
            raise ValueError(f"etcd error: {reply.get('error') or reply.get('message')}")
        if resp.status != 200:
            raise ValueError(f"HTTP {resp.status}: {reply}")
        return reply

    # -- leases ------------------------------------------------------------------------------

    async def grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; its ID."""
        reply = await self.call("lease/grant", {"TTL": int(ttl_s)})
        return int(reply["ID"])

    async def keepalive(self, lease_id: int) -> int:
        """Renew the lease once; its remaining TTL in seconds (0 or less: it has expired)."""
        reply = await self.call("lease/keepalive", {"ID": lease_id})
        result = reply.get("result", reply)
        return int(result.get("TTL", 0))

    async def revoke(self, lease_id: int) -> None:
        """Revoke the lease (its keys go at once)."""
        await self.call("lease/revoke", {"ID": lease_id})

    # -- keys --------------------------------------------------------------------------------

    async def put(self, key: str, value: str, lease_id: int = 0) -> int:
        """Set ``key``; the revision of the write."""
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease_id:
            body["lease"] = lease_id
        reply = await self.call("kv/put", body)
        return int(reply["header"]["revision"])

    async def get(self, key: str) -> KeyValue | None:
        """The key, or None if it does not exist."""
        reply = await self.call("kv/range", {"key": _b64(key)})
        kvs = reply.get("kvs") or []
        return _kv(kvs[0]) if kvs else None

    async def delete(self, key: str) -> None:
        """Delete ``key`` (no error if absent)."""
        await self.call("kv/deleterange", {"key": _b64(key)})

    async def create(self, key: str, value: str, lease_id: int) -> tuple[bool, KeyValue | None]:
        """Create ``key`` under the lease if it does not exist (one transaction).

        Returns
        -------
        (bool, KeyValue or None)
            ``(True, the new key)`` if this call created it; else ``(False, the key in place)``
            (None if it vanished between the compare and the read, which a retry resolves).
        """
        k = _b64(key)
        body = {
            "compare": [{"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
            "success": [{"request_put": {"key": k, "value": _b64(value), "lease": lease_id}}],
            "failure": [{"request_range": {"key": k}}],
        }
        reply = await self.call("kv/txn", body)
        revision = int(reply["header"]["revision"])
        if reply.get("succeeded"):
            return True, KeyValue(key, value, revision, revision, lease_id)
        responses = reply.get("responses") or [{}]
        kvs = responses[0].get("response_range", {}).get("kvs") or []
        return False, (_kv(kvs[0]) if kvs else None)


async def wait_ready(client: EtcdClient, deadline_s: float) -> None:
    """Poll ``maintenance/status`` until etcd answers or ``deadline_s`` seconds pass."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while True:
        try:
            await client.call("maintenance/status", {})
            return
        except EtcdError:
            if loop.time() > end:
                raise
            await asyncio.sleep(0.1)
