"""Proxies that poll each other's queued prefill (``proxy.peers``), on loopback.

Two real proxies in front of the same emulated engines: ``B`` serves ``GET /admin/queue``,
``A`` polls it (``proxy.peers = [B]``) and adds what B queued to its own view of each
engine's queue, which ``prefix-hrw`` decides on.
"""

from __future__ import annotations

import aiohttp
import msgspec
import numpy as np
import pytest
from proxy_harness import MODEL, SHORT_OUTPUTS, Harness, config_toml, serve_proxy, wait_until

from fastroute.config import decode_config
from fastroute.emulator.server import EmulatedFleet, fleet_specs
from fastroute.policy.key_exchange import SINCE_HEADER

pytestmark = pytest.mark.integration

POLL_S = 0.05


def _config(urls: list[str], peers: list[str] | None = None, extra: str = ""):
    proxy = ""
    if peers is not None:
        listed = ", ".join(f'"{u}"' for u in peers)
        proxy = f"peers = [{listed}]\npeer_poll_interval_s = {POLL_S}\n{extra}"
    toml = config_toml(urls).replace("[proxy]\n", "[proxy]\n" + proxy, 1)
    return decode_config(toml, source="peers.toml")


def _queued_view(fleet) -> list[int]:
    """The queued prompt tokens per engine a policy of this proxy decides on."""
    view = fleet.view(np.ones(fleet.n_engines, dtype=bool))
    return view.queued_tokens().tolist()


def test_a_proxy_adds_the_queue_its_peer_reports_and_routes_around_it(h: Harness) -> None:
    async def main() -> None:
        specs = fleet_specs(3, model_name=MODEL, profile="h100", output_lengths=SHORT_OUTPUTS)
        async with (
            EmulatedFleet(specs) as engines,
            serve_proxy(_config(engines.urls)) as (b, b_url, _),
            serve_proxy(_config(engines.urls, [b_url])) as (a, a_url, _),
            aiohttp.ClientSession() as s,
        ):
            async with s.get(b_url + "/admin/queue") as resp:
                assert resp.status == 200
                assert await resp.json() == {"engines": {}}
            body = h.chat_body("x" * 2000)  # past one 512-byte block: prefix-hrw's keys
            async with s.post(a_url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()
                home = resp.headers["x-fastroute-engine"]
            i = a.context.fleet.names.index(home)

            # B has 200,000 prompt tokens queued on A's home (as its request path counts them).
            queued = b.context.fleet.attempt_started(i, tokens=200_001, queued_tokens=200_000)
            async with s.get(b_url + "/admin/queue") as resp:
                assert await resp.json() == {"engines": {home: 200_000}}
            await wait_until(lambda: _queued_view(a.context.fleet)[i] == 200_000, timeout=5.0)
            assert a.context.fleet.stats.own_queued_tokens()[i] == 0  # A queued nothing
            async with s.get(a_url + "/admin/queue") as resp:  # A reports its own only
                assert await resp.json() == {"engines": {}}
            async with s.post(a_url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()
                assert resp.headers["x-fastroute-engine"] != home
            async with s.get(a_url + "/metrics") as resp:
                text = await resp.text()
            assert "fastroute_proxy_peer_queued_tokens 200000.0" in text
            assert f'fastroute_proxy_peer_polls_total{{outcome="ok",peer="{b_url}"}}' in text

            # B's prefill ends: A sees it at its next poll and goes home again.
            queued.done()
            b.context.fleet.attempt_finished(i, 200_001)
            await wait_until(lambda: _queued_view(a.context.fleet)[i] == 0, timeout=5.0)
            async with s.post(a_url + "/v1/chat/completions", json=body) as resp:
                await resp.read()
                assert resp.headers["x-fastroute-engine"] == home

    h.run(main())


def test_a_peer_that_stops_answering_counts_as_no_queue(h: Harness) -> None:
    async def main() -> None:
        specs = fleet_specs(2, model_name=MODEL, profile="h100", output_lengths=SHORT_OUTPUTS)
        async with EmulatedFleet(specs) as engines:
            async with serve_proxy(_config(engines.urls)) as (b, b_url, b_server):
                b.context.fleet.attempt_started(1, queued_tokens=5000)
                async with serve_proxy(_config(engines.urls, [b_url])) as (a, a_url, _):
                    fleet = a.context.fleet
                    await wait_until(lambda: _queued_view(fleet)[1] == 5000, 5.0)
                    await b_server.drain(1.0)  # B stops listening: polls are refused
                    poller = a.signals.peers
                    assert poller is not None
                    failed = poller.peers[0].failed_total
                    await wait_until(lambda: poller.peers[0].failed_total > failed, 5.0)
                    await wait_until(lambda: _queued_view(fleet)[1] == 0, 5.0)
                    async with aiohttp.ClientSession() as s:
                        async with s.get(a_url + "/metrics") as resp:
                            text = await resp.text()
                    assert f'outcome="failed",peer="{b_url}"' in text

    h.run(main())


def test_the_queue_endpoint_follows_the_admin_rule(h: Harness) -> None:
    from fastroute.proxy.routes import get_reply

    async def main() -> None:
        specs = fleet_specs(2, model_name=MODEL, profile="h100", output_lengths=SHORT_OUTPUTS)
        async with EmulatedFleet(specs) as engines:
            token = "t" * 20
            config = _config(engines.urls, [], f'admin_token = "{token}"\n')
            async with serve_proxy(config) as (app, _, _):
                ctx = app.context
                far = "192.0.2.7"
                assert get_reply(ctx, "/admin/queue", {}, far).status == 403
                auth = {"Authorization": f"Bearer {token}"}
                assert get_reply(ctx, "/admin/queue", auth, far).status == 200
                assert get_reply(ctx, "/admin/queue", {}, "127.0.0.1").status == 200
                # A key-log position that is not one: a specific 400. Without a key log (no
                # supervisor here) a valid one is answered with the queues alone.
                for since in ("soon", "-2", str(1 << 63)):
                    bad = get_reply(ctx, "/admin/queue", {SINCE_HEADER: since}, "127.0.0.1")
                    assert bad.status == 400 and b"bad_key_log_position" in bad.body
                ok = get_reply(ctx, "/admin/queue", {SINCE_HEADER: "-1"}, "127.0.0.1")
                assert ok.status == 200 and msgspec.json.decode(ok.body) == {"engines": {}}

    h.run(main())
