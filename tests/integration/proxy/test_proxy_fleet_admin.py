"""Engines that join and leave a running ``fastroute serve --workers 2``: the admin API and
DNS discovery (a real DNS server on loopback), through the one reload path.

Streams are held open by an engine slowdown fault and released by clearing it (as in
``test_proxy_workers``), so a removed engine's in-flight stream is checked to finish.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import test_proxy_workers as workers
from proxy_harness import MODEL, Harness, chat_body, config_toml
from test_proxy_workers import HOLD, Stream, engines, fresh_session, open_stream, wait_workers

from fastroute.hashing import engine_id
from fastroute.tables.stats import StatsBlock
from fastroute.testing.dns import DnsTestServer

pytestmark = pytest.mark.integration

# The process-tree fixtures of the workers tests (a ``fastroute serve`` per test).
shm = workers.shm
spawn = workers.spawn

#: Requests tried before giving up on seeing an engine from every worker.
MAX_PROBES = 200


async def admin(
    s: aiohttp.ClientSession, method: str, url: str, json: Any = None
) -> tuple[int, Any]:
    async with s.request(method, url, json=json) as r:
        return r.status, await r.json()


async def routes_seen(s: aiohttp.ClientSession, url: str, want: str, workers: int = 2) -> set[int]:
    """Send chats on fresh connections until ``want`` served a request from ``workers``
    distinct workers; the workers seen."""
    seen: set[int] = set()
    for i in range(MAX_PROBES):
        async with s.post(url + "/v1/chat/completions", json=chat_body(f"probe {i}")) as r:
            assert r.status == 200, await r.text()
            if r.headers["x-fastroute-engine"] == want:
                seen.add(int(r.headers["x-fastroute-worker"]))
        if len(seen) >= workers:
            return seen
    raise AssertionError(f"{want} served only workers {seen} in {MAX_PROBES} requests")


async def engines_served(s: aiohttp.ClientSession, url: str, n: int) -> set[str]:
    names: set[str] = set()
    for i in range(n):
        async with s.post(url + "/v1/chat/completions", json=chat_body(f"after {i}")) as r:
            assert r.status == 200, await r.text()
            names.add(r.headers["x-fastroute-engine"])
    return names


async def stream_on(url: str, engine: str) -> Stream:
    """Open streams until one lands on ``engine`` (the others are closed)."""
    for i in range(40):
        st = await open_stream(url, f"hold {i}")
        if st.engine == engine:
            return st
        st.resp.close()
        await st.session.close()
    raise AssertionError(f"no stream landed on {engine}")


ROUND_ROBIN = '[policy]\ndefault = "round-robin"\n'


def test_admin_api_adds_drains_removes_and_a_restart_keeps_added_engines(
    h: Harness, spawn: Any, tmp_path: Path
) -> None:
    async def main() -> None:
        async with engines(3) as fleet:
            proxy = spawn(config_toml(fleet.urls[:1], ROUND_ROBIN))
            await wait_workers(h, proxy, 2)
            api = proxy.url + "/admin/engines"
            added = {"name": "added-1", "url": fleet.urls[1], "models": [MODEL]}
            async with fresh_session() as s:
                # Errors first: nothing is written.
                status, body = await admin(s, "POST", api, {"name": "x", "url": fleet.urls[1]})
                assert status == 400 and "models" in body["error"]["message"], body
                bad_region = {**added, "region": "mars"}
                status, body = await admin(s, "POST", api, bad_region)
                assert status == 400 and "mars" in body["error"]["message"], body
                status, body = await admin(s, "POST", api, {**added, "name": "engine-0"})
                assert status == 409, body
                status, body = await admin(s, "DELETE", api + "/nope")
                assert status == 404, body
                status, body = await admin(s, "DELETE", api + "/engine-0")
                assert status == 409, body  # a config engine: edit the file or drain
                status, body = await admin(s, "POST", api + "/engine-0/drain")
                assert status == 409, body  # it is the only engine
                assert not (tmp_path / "fastroute.toml.engines.json").exists()

                status, body = await admin(s, "POST", api, added)
                assert status == 201 and body["source"] == "admin", body
                assert (tmp_path / "fastroute.toml.engines.json").exists()
                assert len(await routes_seen(s, proxy.url, "added-1")) == 2  # every worker
                stats = StatsBlock.attach(proxy.stats_name)
                try:  # the supervisor gave it a shared slot
                    assert engine_id("added-1") in {int(i) for i in stats.engine_ids}
                finally:
                    stats.close()
                status, body = await admin(s, "GET", api)
                listed = {e["name"]: e for e in body["engines"]}
                assert listed["added-1"]["source"] == "admin"
                assert listed["engine-0"]["source"] == "config"
                assert "api_key" not in listed["added-1"]

                # DELETE drains: a stream on the deleted engine finishes.
                await fleet[1].set_faults(slowdown=HOLD)
                stream = await stream_on(proxy.url, "added-1")
                try:
                    status, body = await admin(s, "DELETE", api + "/added-1")
                    assert status == 200 and body["state"] == "removed", body

                    async def gone() -> bool:
                        return await engines_served(s, proxy.url, 8) == {"engine-0"}

                    await h.wait_until(gone, timeout=10.0, interval=0.05)
                    assert stream.resp.content.at_eof() is False
                    await fleet[1].clear_faults()
                    events, done = await stream.finish(h)
                    assert done and not any("error" in e for e in events)
                finally:
                    stream.resp.close()
                    await stream.session.close()

                # Drain: engine-0 listed as draining, new requests go to added-2.
                added2 = {"name": "added-2", "url": fleet.urls[2], "models": added["models"]}
                assert (await admin(s, "POST", api, added2))[0] == 201
                await routes_seen(s, proxy.url, "added-2")
                status, body = await admin(s, "POST", api + "/engine-0/drain")
                assert status == 200 and body["state"] == "draining", body

                async def drained() -> bool:
                    return await engines_served(s, proxy.url, 8) == {"added-2"}

                await h.wait_until(drained, timeout=10.0, interval=0.05)

            # Restart: the state file keeps added-2 and the drain mark.
            proxy.proc.send_signal(signal.SIGTERM)
            assert proxy.proc.wait(timeout=20) == 0, proxy.logs()
            proxy = spawn(config_toml(fleet.urls[:1], ROUND_ROBIN))
            await wait_workers(h, proxy, 2)
            async with fresh_session() as s:
                assert await engines_served(s, proxy.url, 8) == {"added-2"}
                status, body = await admin(s, "GET", proxy.url + "/admin/engines")
                states = {e["name"]: (e["source"], e["state"]) for e in body["engines"]}
                assert states == {
                    "engine-0": ("config", "draining"),
                    "added-2": ("admin", "active"),
                }, states
                status, body = await admin(s, "POST", proxy.url + "/admin/engines/engine-0/resume")
                assert status == 200 and body["state"] == "active"

    h.run(main(), timeout=120.0)


def test_dns_discovery_adds_drains_and_survives_resolution_failures(h: Harness, spawn: Any) -> None:
    async def main() -> None:
        async with engines(3) as fleet:
            ports = [int(u.rsplit(":", 1)[1]) for u in fleet.urls]
            with DnsTestServer() as dns:
                dns.set_a("e.test", ["127.0.0.1"])
                dns.set_srv("_http._tcp.pool.test", [("e.test", ports[1])])
                discovery = (
                    '[[discovery]]\nname = "pool"\n'
                    'dns_name = "_http._tcp.pool.test"\nrecord = "SRV"\n'
                    f'nameserver = "{dns.nameserver}"\ninterval_s = 0.3\ntimeout_s = 0.2\n'
                    f'models = ["{MODEL}"]\n'
                )
                proxy = spawn(config_toml(fleet.urls[:1], ROUND_ROBIN + discovery))
                await wait_workers(h, proxy, 2)
                first, second = f"pool/127.0.0.1:{ports[1]}", f"pool/127.0.0.1:{ports[2]}"
                async with fresh_session() as s:
                    assert len(await routes_seen(s, proxy.url, first)) == 2
                    # Records change mid-test: the old engine drains (its stream finishes).
                    await fleet[1].set_faults(slowdown=HOLD)
                    stream = await stream_on(proxy.url, first)
                    try:
                        dns.set_srv("_http._tcp.pool.test", [("e.test", ports[2])])

                        async def moved() -> bool:
                            return await engines_served(s, proxy.url, 8) == {"engine-0", second}

                        await h.wait_until(moved, timeout=10.0, interval=0.05)
                        await fleet[1].clear_faults()
                        events, done = await stream.finish(h)
                        assert done and not any("error" in e for e in events)
                    finally:
                        stream.resp.close()
                        await stream.session.close()
                    # A failing server: the last set stays, failures are counted.
                    dns.failing = True

                    async def counted() -> bool:
                        status, body = await admin(s, "GET", proxy.url + "/admin/engines")
                        return body["discovery"][0]["failures"] >= 2

                    await h.wait_until(counted, timeout=10.0, interval=0.1)
                    assert await engines_served(s, proxy.url, 8) == {"engine-0", second}
                    status, body = await admin(s, "GET", proxy.url + "/admin/engines")
                    sources = {e["name"]: e["source"] for e in body["engines"]}
                    assert sources == {"engine-0": "config", second: "dns"}
                    assert "SERVFAIL" in body["discovery"][0]["last_error"]

    h.run(main(), timeout=90.0)


def test_in_process_app_without_supervisor_reloads_itself_and_checks_access(
    h: Harness, tmp_path: Path
) -> None:
    """A ProxyApp built from a config file (no supervisor): a change reloads the app itself;
    off loopback only the admin token opens the API."""
    from fastroute.config import load_config
    from fastroute.proxy.proxy_app import ProxyApp
    from fastroute.testing.servers import serve_proxy_app

    async def main() -> None:
        async with engines(2) as fleet:
            config_path = tmp_path / "fastroute.toml"
            token = "t" * 20
            config_path.write_text(
                config_toml(fleet.urls[:1], ROUND_ROBIN).replace(
                    "[proxy]\n", f'[proxy]\nadmin_token = "{token}"\n'
                )
            )
            app = ProxyApp(load_config(config_path), config_path=config_path)
            async with serve_proxy_app(app) as (url, _server), fresh_session() as s:
                api = url + "/admin/engines"
                added = {"name": "added-1", "url": fleet.urls[1], "models": [MODEL]}
                assert (await admin(s, "POST", api, added))[0] == 201
                await h.wait_until(
                    lambda: "added-1" in {e.name for e in app.context.config.engines},
                    timeout=5.0,
                )
                assert "added-1" in await engines_served(s, url, 6)
                status, _ = await admin(s, "PUT", api)
                assert status == 405
                status, _ = await admin(s, "GET", api + "/added-1")
                assert status == 405  # an engine's path takes DELETE only
                # Access off loopback (the front end passes the client address): the token only.
                off_host = "192.0.2.7"
                bearer = {"Authorization": f"Bearer {token}"}
                wrong = {"Authorization": "Bearer " + "x" * 20}
                reply = app.fleet_admin.reply
                assert (await reply("GET", "/admin/engines", None, {}, off_host)).status == 403
                assert (await reply("GET", "/admin/engines", None, wrong, off_host)).status == 403
                assert (await reply("GET", "/admin/engines", None, bearer, off_host)).status == 200
                refused = await reply("DELETE", "/admin/engines/added-1", None, {}, off_host)
                assert refused.status == 403
                assert "added-1" in {e.name for e in app.context.config.engines}

    h.run(main(), timeout=60.0)
