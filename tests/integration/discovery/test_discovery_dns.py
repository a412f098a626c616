"""The DNS resolver and the discovery runner against a real DNS server on loopback."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from fastroute.config import DiscoveryConfig
from fastroute.discovery.dns import ResolveError, resolve
from fastroute.discovery.runner import DiscoveryRunner
from fastroute.discovery.state_file import Address, read_state
from fastroute.testing.dns import DnsTestServer

pytestmark = pytest.mark.integration

MODEL = "m"


def discovery(nameserver: str, **fields: object) -> DiscoveryConfig:
    data = {"name": "pool", "dns_name": "pool.test", "models": [MODEL], "nameserver": nameserver}
    return msgspec.convert({**data, **fields}, DiscoveryConfig)


def test_a_and_aaaa_records_with_the_configured_port() -> None:
    with DnsTestServer() as dns:
        dns.set_a("pool.test", ["10.0.0.2", "10.0.0.1", "fd00::1"])
        found = asyncio.run(resolve(discovery(dns.nameserver, port=8000)))
    assert found == (Address("10.0.0.1", 8000), Address("10.0.0.2", 8000), Address("fd00::1", 8000))


def test_srv_records_give_host_and_port_targets_resolved_through_the_same_server() -> None:
    with DnsTestServer() as dns:
        dns.set_a("e1.test", ["127.0.0.1"])
        dns.set_a("e2.test", ["127.0.0.2"])
        dns.set_srv("_http._tcp.pool.test", [("e1.test", 9001), ("e2.test", 9002)])
        disc = discovery(dns.nameserver, dns_name="_http._tcp.pool.test", record="SRV")
        found = asyncio.run(resolve(disc))
    assert found == (Address("127.0.0.1", 9001), Address("127.0.0.2", 9002))


def test_failures_raise_and_an_empty_answer_is_an_empty_set() -> None:
    with DnsTestServer() as dns:
        dns.set_a("pool.test", [])
        assert asyncio.run(resolve(discovery(dns.nameserver, port=8000))) == ()
        with pytest.raises(ResolveError, match="NXDOMAIN"):
            asyncio.run(resolve(discovery(dns.nameserver, port=8000, dns_name="gone.test")))
        dns.failing = True
        with pytest.raises(ResolveError, match="SERVFAIL"):
            asyncio.run(resolve(discovery(dns.nameserver, port=8000)))
    # Nobody answers on that port any more: a bounded timeout, not a hang.
    with pytest.raises(ResolveError):
        asyncio.run(resolve(discovery(dns.nameserver, port=8000, timeout_s=0.2)))


def test_system_resolver_for_a_records_without_nameserver() -> None:
    disc = msgspec.convert(
        {"name": "local", "dns_name": "localhost", "models": [MODEL], "port": 8000},
        DiscoveryConfig,
    )
    found = asyncio.run(resolve(disc))
    assert Address("127.0.0.1", 8000) in found or Address("::1", 8000) in found


def test_runner_records_changes_keeps_the_last_set_on_failure_and_counts(tmp_path: Path) -> None:
    state = tmp_path / "f.toml.engines.json"
    changes: list[int] = []
    with DnsTestServer() as dns:
        dns.set_a("pool.test", ["10.0.0.1"])
        disc = discovery(dns.nameserver, port=8000, interval_s=0.5, timeout_s=0.2)
        runner = DiscoveryRunner([disc], state, lambda: changes.append(1))

        async def main() -> None:
            assert await runner.resolve_once(disc) is True
            assert await runner.resolve_once(disc) is False  # same set: no reload
            dns.set_a("pool.test", ["10.0.0.1", "10.0.0.3"])
            assert await runner.resolve_once(disc) is True
            dns.failing = True
            assert await runner.resolve_once(disc) is False

        asyncio.run(main())
    status = read_state(state).discovery["pool"]
    assert status.addresses == (Address("10.0.0.1", 8000), Address("10.0.0.3", 8000))
    assert status.failures == 1 and "SERVFAIL" in (status.last_error or "")
    assert changes == [1, 1]


def test_runner_thread_resolves_on_its_schedule_and_stops(tmp_path: Path) -> None:
    state = tmp_path / "f.toml.engines.json"
    with DnsTestServer() as dns:
        dns.set_a("pool.test", ["10.0.0.1"])
        disc = discovery(dns.nameserver, port=8000, interval_s=0.1, timeout_s=0.05)
        runner = DiscoveryRunner([disc], state, lambda: None)
        runner.start()
        try:
            for _ in range(100):  # bounded: 5 s
                if dns.queries >= 3:
                    break
                asyncio.run(asyncio.sleep(0.05))
        finally:
            runner.stop()
        assert dns.queries >= 3
    assert read_state(state).discovery["pool"].addresses == (Address("10.0.0.1", 8000),)


def test_answers_beyond_512_bytes_arrive_whole_over_edns0() -> None:
    addresses = [f"10.0.{i // 250}.{i % 250 + 1}" for i in range(100)]  # ≈ 1.6 kB of answers
    with DnsTestServer() as dns:
        dns.set_a("pool.test", addresses)
        found = asyncio.run(resolve(discovery(dns.nameserver, port=8000)))
    assert {a.host for a in found} == set(addresses)
