"""Resolve a ``[[discovery]]`` name to engine addresses, without blocking the event loop.

``record = "A"`` without a ``nameserver``: the system resolver (``loop.getaddrinfo``, A
and AAAA, run in the loop's executor). With a ``nameserver``, and for ``record = "SRV"``:
DNS queries packed and parsed with ``dnslib`` over asyncio UDP (the system's first
``/etc/resolv.conf`` nameserver when none is configured). SRV targets are resolved to
their A/AAAA records through the same server (from the answer's additional section when
it carries them), so a target name the system resolver does not know still works.

A failure (timeout, SERVFAIL, NXDOMAIN, no server) raises :class:`ResolveError`; the
caller keeps the last set. An answer without records (NOERROR, empty) is an empty set.
"""

from __future__ import annotations

import asyncio
import ipaddress
import random
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fastroute.config import DiscoveryConfig
from fastroute.discovery.state_file import Address

__all__ = ["ResolveError", "resolve", "query", "parse_nameserver", "DNS_PORT", "RESOLV_CONF"]

#: The DNS port, of a nameserver given without one in ``/etc/resolv.conf``.
DNS_PORT = 53
#: Where the system's nameservers are listed.
RESOLV_CONF = Path("/etc/resolv.conf")
#: The EDNS0 UDP buffer queries advertise, bytes (a larger answer arrives truncated and is
#: used as far as it goes: no TCP fallback).
_MAX_UDP_BYTES = 4096


class ResolveError(Exception):
    """A name could not be resolved (the last known set stays in force)."""


def parse_nameserver(text: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) as a (host, port) pair."""
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def _system_nameserver(path: Path = RESOLV_CONF) -> tuple[str, int]:
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ResolveError(f"no nameserver configured and {path} unreadable: {exc}") from exc
    for line in lines:
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            return parts[1], DNS_PORT
    raise ResolveError(f"no nameserver configured and none in {path}")


class _Reply(asyncio.DatagramProtocol):
    def __init__(self, qid: int) -> None:
        self.qid = qid
        self.done: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    def datagram_received(self, data: bytes, addr: Any) -> None:
        if len(data) >= 2 and int.from_bytes(data[:2], "big") == self.qid and not self.done.done():
            self.done.set_result(data)

    def error_received(self, exc: Exception) -> None:
        if not self.done.done():
            self.done.set_exception(exc)


async def query(server: tuple[str, int], qname: str, qtype: str, timeout_s: float) -> Any:
    """Ask ``server`` one question over UDP; return the parsed ``dnslib.DNSRecord``.

    Raises
    ------
    ResolveError
        Timeout, network error, a malformed answer, or an rcode other than NOERROR.
    """
    try:
        import dnslib
    except ImportError as exc:  # a test extra, not a core dependency
        raise ResolveError(
            f"{qname} {qtype}: SRV records and an explicit nameserver need the dnslib package"
        ) from exc

    request = dnslib.DNSRecord.question(qname, qtype)
    request.header.id = random.randrange(1 << 16)
    request.add_ar(dnslib.EDNS0(udp_len=_MAX_UDP_BYTES))  # answers beyond 512 bytes over UDP
    loop = asyncio.get_running_loop()
    try:
        transport, proto = await loop.create_datagram_endpoint(
            lambda: _Reply(request.header.id), remote_addr=server
        )
    except OSError as exc:
        raise ResolveError(f"{qname} {qtype}: cannot reach {server}: {exc}") from exc
    try:
        transport.sendto(request.pack())
        data = await asyncio.wait_for(proto.done, timeout_s)
    except TimeoutError as exc:
        raise ResolveError(f"{qname} {qtype}: no answer from {server} in {timeout_s} s") from exc
    except OSError as exc:
        raise ResolveError(f"{qname} {qtype}: {server}: {exc}") from exc
    finally:
        transport.close()
    try:
        answer = dnslib.DNSRecord.parse(data)
    except dnslib.DNSError as exc:
        raise ResolveError(f"{qname} {qtype}: malformed answer from {server}: {exc}") from exc
    rcode = answer.header.rcode
    if rcode != dnslib.RCODE.NOERROR:
        raise ResolveError(f"{qname} {qtype}: {dnslib.RCODE.get(rcode)} from {server}")
    return answer


def _records(answer: Any, qtype: str, section: Iterable[Any] | None = None) -> list[Any]:
    import dnslib

    want = getattr(dnslib.QTYPE, qtype)
    return [rr for rr in (answer.rr if section is None else section) if rr.rtype == want]


async def _addresses_via(server: tuple[str, int], name: str, timeout_s: float) -> list[str]:
    hosts: list[str] = []
    for qtype in ("A", "AAAA"):
        answer = await query(server, name, qtype, timeout_s)
        hosts += [str(rr.rdata) for rr in _records(answer, qtype)]
    return hosts


async def _resolve_srv(disc: DiscoveryConfig, server: tuple[str, int]) -> set[Address]:
    answer = await query(server, disc.dns_name, "SRV", disc.timeout_s)
    glue: dict[str, list[str]] = {}
    for qtype in ("A", "AAAA"):
        for rr in _records(answer, qtype, answer.ar):
            glue.setdefault(str(rr.rname).rstrip(".").lower(), []).append(str(rr.rdata))
    found: set[Address] = set()
    for rr in _records(answer, "SRV"):
        target = str(rr.rdata.target).rstrip(".")
        port = int(rr.rdata.port)
        if _is_ip(target):
            hosts = [target]
        else:
            hosts = glue.get(target.lower()) or await _addresses_via(server, target, disc.timeout_s)
        found.update(Address(h, port) for h in hosts)
    return found


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


async def _resolve_system(disc: DiscoveryConfig) -> set[Address]:
    assert disc.port is not None
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(disc.dns_name, disc.port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ResolveError(f"{disc.dns_name}: {exc}") from exc
    return {Address(str(info[4][0]), disc.port) for info in infos}


async def resolve(disc: DiscoveryConfig) -> tuple[Address, ...]:
    """The addresses ``disc`` resolves to now, sorted; bounded by ``disc.timeout_s`` per query.

    Raises
    ------
    ResolveError
        The resolution failed; keep the last set.
    """
    if disc.record == "A" and disc.nameserver is None:
        try:
            found = await asyncio.wait_for(_resolve_system(disc), disc.timeout_s)
        except TimeoutError as exc:
            raise ResolveError(f"{disc.dns_name}: no answer in {disc.timeout_s} s") from exc
    else:
        server = (
            parse_nameserver(disc.nameserver)
            if disc.nameserver is not None
            else _system_nameserver()
        )
        if disc.record == "SRV":
            found = await _resolve_srv(disc, server)
        else:
            assert disc.port is not None
            port = disc.port
            found = {
                Address(h, port)
                for h in await _addresses_via(server, disc.dns_name, disc.timeout_s)
            }
    return tuple(sorted(found))
