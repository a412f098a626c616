"""A real DNS server on loopback for tests and benchmarks, with records changed at run time.

:class:`DnsTestServer` answers UDP queries on ``127.0.0.1`` (an ephemeral port) from a
table the caller edits (:meth:`DnsTestServer.set_a`, :meth:`DnsTestServer.set_srv`), or
fails every query with SERVFAIL (:attr:`DnsTestServer.failing`). It runs ``dnslib``'s
server in a thread of its own.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import TracebackType
from typing import Any

__all__ = ["DnsTestServer", "TTL_S"]

#: TTL of every answer, seconds (the discovery re-resolves on its own schedule anyway).
TTL_S = 1


def _fqdn(name: str) -> str:
    return name if name.endswith(".") else name + "."


class DnsTestServer:
    """A DNS server for a few names; use as a context manager.

    Attributes
    ----------
    nameserver : str
        ``"127.0.0.1:<port>"``, as ``[[discovery]].nameserver`` takes it.
    failing : bool
        Answer SERVFAIL to everything while True.
    queries : int
        Queries answered so far.
    """

    def __init__(self) -> None:
        import dnslib
        import dnslib.server

        self._dnslib = dnslib
        self._lock = threading.Lock()
        self._a: dict[str, list[str]] = {}
        self._srv: dict[str, list[tuple[str, int]]] = {}
        self.failing = False
        self.queries = 0
        outer = self

        class _Resolver(dnslib.server.BaseResolver):  # type: ignore[misc]
            def resolve(self, request: Any, handler: Any) -> Any:
                return outer._answer(request)

        class _Quiet(dnslib.server.DNSLogger):  # type: ignore[misc]
            def __init__(self) -> None:
                super().__init__(log="-request,-reply,-truncated,-error,-recv,-send,-data")

        self._server = dnslib.server.DNSServer(
            _Resolver(), address="127.0.0.1", port=0, logger=_Quiet()
        )
        port = int(self._server.server.server_address[1])
        self.nameserver = f"127.0.0.1:{port}"

    def set_a(self, name: str, addresses: Sequence[str]) -> None:
        """Answer ``name`` with these A (IPv4) / AAAA (IPv6) addresses."""
        with self._lock:
            self._a[_fqdn(name).lower()] = list(addresses)

    def set_srv(self, name: str, targets: Sequence[tuple[str, int]]) -> None:
        """Answer ``name`` with SRV records ``(target, port)`` (targets need :meth:`set_a`)."""
        with self._lock:
            self._srv[_fqdn(name).lower()] = [(_fqdn(t), p) for t, p in targets]

    def _answer(self, request: Any) -> Any:
        dl = self._dnslib
        reply = request.reply()
        qname = str(request.q.qname).lower()
        qtype = dl.QTYPE[request.q.qtype]
        with self._lock:
            self.queries += 1
            if self.failing:
                reply.header.rcode = dl.RCODE.SERVFAIL
                return reply
            known = qname in self._a or qname in self._srv
            if not known:
                reply.header.rcode = dl.RCODE.NXDOMAIN
                return reply
            if qtype in ("A", "AAAA"):
                for address in self._a.get(qname, []):
                    v6 = ":" in address
                    if (qtype == "AAAA") == v6:
                        rdata = dl.AAAA(address) if v6 else dl.A(address)
                        reply.add_answer(
                            dl.RR(qname, getattr(dl.QTYPE, qtype), rdata=rdata, ttl=TTL_S)
                        )
            elif qtype == "SRV":
                for target, port in self._srv.get(qname, []):
                    rdata = dl.SRV(priority=0, weight=1, port=port, target=target)
                    reply.add_answer(dl.RR(qname, dl.QTYPE.SRV, rdata=rdata, ttl=TTL_S))
        return reply

    def __enter__(self) -> DnsTestServer:
        self._server.start_thread()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.stop()
        self._server.server.server_close()
