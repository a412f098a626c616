"""``fastroute serve --workers N`` as a real process tree: supervisor + workers.

Engines are :class:`EmulatedFleet` engines on the test's loop; the proxy is a real
``python -m fastroute serve`` subprocess in its own session (the fixture kills the whole
process group whatever happens). Workers are told apart by the ``x-fastroute-worker``
response header / the ``pid`` field of ``/health``. Streams (200 tokens) are held open by
an engine slowdown fault (≈0.7 s per token at slowdown 100) and released by clearing it,
so no test depends on a stream's natural length.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from proxy_harness import MODEL, SHORT_OUTPUTS, Harness, chat_body, config_toml

from fastroute._core.keylog_py import WHOLE
from fastroute.emulator.server import EmulatedFleet, fleet_specs
from fastroute.hashing import engine_id
from fastroute.tables.key_log import KeyLogSegment, key_log_name
from fastroute.tables.stats import Counter, StatsBlock

pytestmark = pytest.mark.integration

#: Slowdown that holds a stream open (one token per ~0.7 s) until it is cleared.
HOLD = 100.0
START_TIMEOUT_S = 20.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Proxy:
    """A ``fastroute serve`` process tree."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path, stats: str) -> None:
        self.proc = proc
        self.url = url
        self.log = log
        self.stats_name = stats

    def logs(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def alive_group(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        return True


@pytest.fixture
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private segment directory for the proxy and the test (no /dev/shm litter)."""
    d = tmp_path / "shm"
    d.mkdir()
    monkeypatch.setenv("FASTROUTE_SHM_DIR", str(d))
    return d


@pytest.fixture
def spawn(tmp_path: Path, shm: Path) -> Iterator[Any]:
    """Start ``fastroute serve`` trees; kill their process groups at teardown."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(
        config_text: str,
        workers: int = 2,
        stats: str | None = None,
        port: int | None = None,
        config_name: str = "fastroute.toml",
    ) -> Proxy:
        port = port or _free_port()
        stats = stats or stats_name()
        config = tmp_path / config_name  # a restart reuses it; two live trees need two
        config.write_text(_with_stats(config_text, stats))
        log = tmp_path / f"serve-{len(procs)}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "fastroute", "serve", "--config", str(config)]
                + ["--port", str(port), "--workers", str(workers)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )
        procs.append(proc)
        return Proxy(proc, f"http://127.0.0.1:{port}", log, stats)

    try:
        yield start
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


def stats_name() -> str:
    """A fresh stats block name."""
    return f"fastroute-test-stats-{uuid.uuid4().hex[:12]}"


def _with_stats(config_text: str, stats: str) -> str:
    return config_text.replace("[proxy]\n", f'[proxy]\nstats_name = "{stats}"\n', 1)


@contextlib.asynccontextmanager
async def engines(n: int) -> AsyncIterator[EmulatedFleet]:
    specs = fleet_specs(n, model_name=MODEL, profile="h100", output_lengths=SHORT_OUTPUTS)
    async with EmulatedFleet(specs) as fleet:
        yield fleet


def fresh_session() -> aiohttp.ClientSession:
    """A client that opens a new connection per request (so SO_REUSEPORT spreads them)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(force_close=True),
        timeout=aiohttp.ClientTimeout(total=15.0),
    )


async def health_pid(s: aiohttp.ClientSession, url: str) -> int | None:
    try:
        async with s.get(url + "/health") as r:
            if r.status != 200:
                return None
            return int((await r.json())["pid"])
    except aiohttp.ClientError:
        return None


async def wait_workers(
    h: Harness, proxy: Proxy, n: int, *, exclude: frozenset[int] = frozenset()
) -> set[int]:
    """Poll ``/health`` on fresh connections until ``n`` distinct worker pids answered."""
    seen: set[int] = set()
    async with fresh_session() as s:

        async def enough() -> bool:
            assert proxy.proc.poll() is None, proxy.logs()
            pid = await health_pid(s, proxy.url)
            if pid is not None and pid not in exclude:
                seen.add(pid)
            return len(seen) >= n

        try:
            await h.wait_until(enough, timeout=START_TIMEOUT_S, interval=0.02)
        except AssertionError:
            raise AssertionError(f"saw workers {seen}, wanted {n}\n{proxy.logs()}") from None
    return seen


async def metric(s: aiohttp.ClientSession, url: str, line_prefix: str) -> tuple[int, float]:
    """(worker pid, value of the first /metrics sample starting with ``line_prefix``)."""
    async with s.get(url + "/metrics") as r:
        text = await r.text()
        pid = int(r.headers["x-fastroute-worker"])
    for line in text.splitlines():
        if line.startswith(line_prefix):
            return pid, float(line.rsplit(" ", 1)[1])
    return pid, 0.0


class Stream:
    """An SSE response through the proxy, first chunk already read."""

    def __init__(self, resp: aiohttp.ClientResponse, session: aiohttp.ClientSession) -> None:
        self.resp = resp
        self.session = session
        self.worker = int(resp.headers["x-fastroute-worker"])
        self.engine = resp.headers["x-fastroute-engine"]

    async def finish(self, h: Harness) -> tuple[list[dict[str, Any]], bool]:
        try:
            return await asyncio.wait_for(h.read_sse(self.resp), 15.0)
        finally:
            self.resp.release()
            await self.session.close()


async def open_stream(url: str, user: str, max_tokens: int = 200) -> Stream:
    s = fresh_session()
    body = chat_body(user, stream=True, max_tokens=max_tokens, ignore_eos=True)
    try:
        resp = await s.post(url + "/v1/chat/completions", json=body)
        assert resp.status == 200, await resp.text()
        first = await asyncio.wait_for(resp.content.readline(), 10.0)
        assert first.startswith(b"data: "), first
    except BaseException:
        await s.close()
        raise
    return Stream(resp, s)


def test_workers_serve_and_share_in_flight(h: Harness, spawn: Any) -> None:
    """Both workers answer; in-flight counts of both land in one shared stats block."""

    async def main() -> None:
        async with engines(2) as fleet:
            proxy = spawn(config_toml(fleet.urls, '[policy]\ndefault = "least-request"\n'))
            await wait_workers(h, proxy, 2)
            stats = StatsBlock.attach(proxy.stats_name)
            streams: list[Stream] = []
            try:
                assert [int(i) for i in stats.engine_ids] == [
                    engine_id(f"engine-{i}") for i in range(2)
                ]
                for f in fleet:
                    await f.set_faults(slowdown=HOLD)
                # Open streams on fresh connections until both workers hold some.
                while len({s.worker for s in streams}) < 2 or len(streams) < 4:
                    assert len(streams) < 24, "SO_REUSEPORT never reached the second worker"
                    streams.append(await open_stream(proxy.url, f"user {len(streams)}"))
                col = stats.column(Counter.IN_FLIGHT)
                assert int(col.sum()) == len(streams)
                # least-request over the *shared* counts keeps the engines even.
                assert abs(int(col[0]) - int(col[1])) <= 1, col
                for f in fleet:
                    await f.clear_faults()
                for st in streams:
                    events, done = await st.finish(h)
                    assert done and not any("error" in e for e in events)
                await h.wait_until(lambda: int(col.sum()) == 0, timeout=5.0)
                requests = stats.column(Counter.REQUESTS)
                assert int(requests.sum()) == len(streams)
            finally:
                for st in streams:
                    st.resp.close()
                    await st.session.close()
                stats.close()

    h.run(main(), timeout=40.0)


def test_sighup_reload_new_requests_use_new_config_open_stream_completes(
    h: Harness, spawn: Any, tmp_path: Path
) -> None:
    """SIGHUP: a removed engine gets no new requests; a stream on it still completes."""

    async def main() -> None:
        async with engines(2) as fleet:
            text = config_toml(fleet.urls[:1])  # engine-0 only
            proxy = spawn(text)
            await wait_workers(h, proxy, 2)
            config = tmp_path / "fastroute.toml"
            await fleet[0].set_faults(slowdown=HOLD)
            stream = await open_stream(proxy.url, "before the reload")
            try:
                assert stream.engine == "engine-0"
                # New config: engine-0 removed, engine-1 (named engine-1) added.
                new_text = config.read_text().replace(fleet.urls[0], fleet.urls[1])
                new_text = new_text.replace('name = "engine-0"', 'name = "engine-1"')
                config.write_text(new_text)
                proxy.proc.send_signal(signal.SIGHUP)
                reloaded: set[int] = set()
                ok = 'fastroute_proxy_config_reloads_total{result="ok"}'
                async with fresh_session() as s:

                    async def both_reloaded() -> bool:
                        pid, value = await metric(s, proxy.url, ok)
                        if value >= 1:
                            reloaded.add(pid)
                        return len(reloaded) == 2

                    await h.wait_until(both_reloaded, timeout=10.0, interval=0.02)
                    assert stream.resp.content.at_eof() is False  # still open across the reload
                    body = chat_body("after the reload")
                    for _ in range(6):
                        async with s.post(proxy.url + "/v1/chat/completions", json=body) as r:
                            assert r.status == 200, await r.text()
                            assert r.headers["x-fastroute-engine"] == "engine-1"
                    # An invalid config is refused and counted; the last good one stays.
                    config.write_text(new_text + "\n[proxy.nonsense\n")
                    proxy.proc.send_signal(signal.SIGHUP)
                    failed: set[int] = set()
                    bad = 'fastroute_proxy_config_reloads_total{result="error"}'

                    async def both_refused() -> bool:
                        pid, value = await metric(s, proxy.url, bad)
                        if value >= 1:
                            failed.add(pid)
                        return len(failed) == 2

                    await h.wait_until(both_refused, timeout=10.0, interval=0.02)
                    async with s.post(proxy.url + "/v1/chat/completions", json=body) as r:
                        assert r.status == 200
                        assert r.headers["x-fastroute-engine"] == "engine-1"
                await fleet[0].clear_faults()
                events, done = await stream.finish(h)
                assert done and not any("error" in e for e in events)
                assert proxy.proc.poll() is None
            finally:
                stream.resp.close()
                await stream.session.close()

    h.run(main(), timeout=40.0)


def test_sigterm_drains_open_stream_and_leaves_nothing(h: Harness, spawn: Any, shm: Path) -> None:
    """SIGTERM: an open stream completes, the tree exits 0, no process or segment left."""

    async def main() -> None:
        async with engines(1) as fleet:
            proxy = spawn(config_toml(fleet.urls))
            pids = await wait_workers(h, proxy, 2)
            assert any(shm.iterdir())
            await fleet[0].set_faults(slowdown=HOLD)
            stream = await open_stream(proxy.url, "drain me")
            try:
                proxy.proc.send_signal(signal.SIGTERM)
                async with fresh_session() as s:

                    async def refused() -> bool:
                        return await health_pid(s, proxy.url) is None

                    await h.wait_until(refused, timeout=10.0, interval=0.02)
                await fleet[0].clear_faults()
                events, done = await stream.finish(h)
                assert done and not any("error" in e for e in events)
            finally:
                stream.resp.close()
                await stream.session.close()
            status = await asyncio.to_thread(proxy.proc.wait, 15.0)
            assert status == 0, proxy.logs()
            await h.wait_until(lambda: not proxy.alive_group(), timeout=5.0)
            for pid in pids:
                assert not Path(f"/proc/{pid}").exists()
            assert list(shm.iterdir()) == []

    h.run(main(), timeout=40.0)


def test_killed_worker_is_restarted(h: Harness, spawn: Any, shm: Path) -> None:
    """A worker killed with SIGKILL is replaced; the proxy keeps serving.

    Also: a stats block name owned by another live process makes the supervisor fall
    back to ``{stats_name}-{pid}`` instead of failing.
    """

    async def main() -> None:
        async with engines(1) as fleet:
            squatter = StatsBlock.create(stats_name(), [1])
            try:
                proxy = spawn(config_toml(fleet.urls), stats=squatter.name)
                pids = await wait_workers(h, proxy, 2)
                assert (shm / f"{proxy.stats_name}-{proxy.proc.pid}").exists()
                victim = min(pids)
                os.kill(victim, signal.SIGKILL)
                fresh = await wait_workers(h, proxy, 2, exclude=frozenset({victim}))
                assert victim not in fresh and len(fresh) == 2
                async with fresh_session() as s:
                    async with s.post(
                        proxy.url + "/v1/chat/completions", json=chat_body("still here")
                    ) as r:
                        assert r.status == 200
                assert proxy.proc.poll() is None
            finally:
                squatter.unlink()

    h.run(main(), timeout=40.0)


def test_one_worker_per_host_polls_the_peers_and_every_worker_sees_their_queue(
    h: Harness, spawn: Any
) -> None:
    """``proxy.peers`` between two supervised proxies: one worker of A polls B (an flock
    decides), and what B queued reaches A's shared counters, which all of A's workers read."""

    async def main() -> None:
        async with engines(2) as fleet:
            b = spawn(config_toml(fleet.urls))
            await wait_workers(h, b, 2)
            b_stats = StatsBlock.attach(b.stats_name)
            extra = f'[proxy]\npeers = ["{b.url}"]\npeer_poll_interval_s = 0.05\n'
            a = spawn(config_toml(fleet.urls).replace("[proxy]\n", extra, 1))
            await wait_workers(h, a, 2)
            a_stats = StatsBlock.attach(a.stats_name)
            try:
                # B's request path queues 5000 prompt tokens on engine-1.
                b_stats.add(b_stats.slot(engine_id("engine-1")), Counter.QUEUED_TOKENS, 5000)
                slot = a_stats.slot(engine_id("engine-1"))
                await h.wait_until(
                    lambda: a_stats.get(slot, Counter.PEER_QUEUED_TOKENS) == 5000, timeout=10.0
                )
                assert a_stats.get(slot, Counter.QUEUED_TOKENS) == 5000  # what A decides on
                async with fresh_session() as s:
                    async with s.get(a.url + "/admin/queue") as r:  # A reports its own only
                        assert await r.json() == {"engines": {}}
                    active: dict[int, float] = {}

                    async def both_workers_seen() -> bool:
                        pid, value = await metric(s, a.url, "fastroute_proxy_peer_poller_active")
                        active[pid] = value
                        return len(active) == 2

                    await h.wait_until(both_workers_seen, timeout=10.0, interval=0.02)
                assert sorted(active.values()) == [0.0, 1.0], active
                b_stats.add(b_stats.slot(engine_id("engine-1")), Counter.QUEUED_TOKENS, -5000)
                await h.wait_until(lambda: a_stats.get(slot, Counter.QUEUED_TOKENS) == 0, 10.0)
            finally:
                a_stats.close()
                b_stats.close()

    h.run(main(), timeout=60.0)


def test_workers_read_each_others_routed_prefix_keys(h: Harness, spawn: Any) -> None:
    """The default policy's workers share the host's key log: every routed request is one
    entry of ``{stats}.keys``, and each worker reads the other's into its tables (its
    ``fastroute_proxy_key_log_entries_total{outcome="observed"}`` grows), losing none."""

    async def main() -> None:
        async with engines(2) as fleet:
            proxy = spawn(config_toml(fleet.urls))
            await wait_workers(h, proxy, 2)
            segment = KeyLogSegment.attach(key_log_name(proxy.stats_name))
            head = memoryview(segment.buffer).cast("Q")
            served: dict[int, int] = {}
            observed: dict[int, float] = {}
            document = "shared document " * 200  # 3.2 kB: depth keys down to 2 kB
            try:
                async with fresh_session() as s:

                    async def one_request() -> None:
                        body = chat_body(f"{document} question {sum(served.values())}")
                        async with s.post(proxy.url + "/v1/chat/completions", json=body) as r:
                            assert r.status == 200, await r.text()
                            pid = int(r.headers["x-fastroute-worker"])
                            served[pid] = served.get(pid, 0) + 1
                        pid, value = await metric(
                            s,
                            proxy.url,
                            'fastroute_proxy_key_log_entries_total{outcome="observed"}',
                        )
                        observed[pid] = value

                    async def both_read_the_other() -> bool:
                        await one_request()
                        return len(observed) == 2 and min(observed.values()) > 0

                    await h.wait_until(both_read_the_other, timeout=20.0, interval=0.0)
                    assert head[4] == sum(served.values())  # one entry per routed request
                    async with s.get(proxy.url + "/metrics") as r:
                        text = await r.text()
                    assert 'fastroute_proxy_key_log_entries_total{outcome="lost"} 0.0' in text
            finally:
                head.release()
                segment.close()

    h.run(main(), timeout=60.0)


def test_two_proxies_pass_each_other_their_routed_prefix_keys_once(h: Harness, spawn: Any) -> None:
    """``proxy.peers`` both ways: each proxy's poll brings the other's own key-log entries
    into its host's log (``fastroute_proxy_peer_key_entries_total{outcome="imported"}``),
    the same keys, and never sends back what it imported: each log ends with exactly the
    deployment's requests, once."""

    async def main() -> None:
        async with engines(2) as fleet:
            ports = _free_port(), _free_port()
            urls = [f"http://127.0.0.1:{port}" for port in ports]

            def config(peer: str) -> str:
                extra = f'[proxy]\npeers = ["{peer}"]\npeer_poll_interval_s = 0.05\n'
                return config_toml(fleet.urls).replace("[proxy]\n", extra, 1)

            a = spawn(config(urls[1]), port=ports[0], config_name="a.toml")
            b = spawn(config(urls[0]), port=ports[1], config_name="b.toml")
            await wait_workers(h, a, 2)
            await wait_workers(h, b, 2)
            segments = [KeyLogSegment.attach(key_log_name(p.stats_name)) for p in (a, b)]
            words = [memoryview(seg.buffer).cast("Q") for seg in segments]
            document = "shared document " * 200  # 3.2 kB: depth keys down to 2 kB
            try:
                async with fresh_session() as s:
                    for i, proxy in enumerate([a, a, a, b, b]):
                        body = chat_body(f"{document} question {i}")
                        async with s.post(proxy.url + "/v1/chat/completions", json=body) as r:
                            assert r.status == 200, await r.text()
                    # Each log: its own requests, then the peer's, imported.
                    await h.wait_until(lambda: words[0][4] == words[1][4] == 5, timeout=10.0)
                    await asyncio.sleep(0.3)  # six more polls each way: nothing echoes back
                    assert words[0][4] == words[1][4] == 5
                    for proxy, imported in ((a, 2.0), (b, 3.0)):  # the poller's count
                        assert await _per_worker(h, s, proxy, _IMPORTED) == {0.0, imported}
                assert sorted(_entry_keys(words[0])) == sorted(_entry_keys(words[1]))
            finally:
                for w in words:
                    w.release()
                for seg in segments:
                    seg.close()

    h.run(main(), timeout=60.0)


_IMPORTED = 'fastroute_proxy_peer_key_entries_total{outcome="imported"'


async def _per_worker(
    h: Harness, s: aiohttp.ClientSession, proxy: Proxy, line_prefix: str
) -> set[float]:
    """The sample's value in each of the proxy's two workers."""
    values: dict[int, float] = {}

    async def both_workers_seen() -> bool:
        pid, value = await metric(s, proxy.url, line_prefix)
        values[pid] = value
        return len(values) == 2

    await h.wait_until(both_workers_seen, timeout=10.0, interval=0.02)
    return set(values.values())


def _entry_keys(words: memoryview) -> list[tuple[int, ...]]:
    """The engine and the keys of every entry of a key log (its words), in log order; not
    an entry's whole prompt key (``WHOLE``), which stays on its host."""
    capacity, entry_words, head = words[2], words[3], words[4]
    keys = []
    for position in range(head):
        at = 8 + (position % capacity) * entry_words
        meta = words[at + 1]
        n_keys = (meta >> 40) & 0xFF
        if meta & WHOLE:
            n_keys -= 1
        keys.append((words[at + 2], *words[at + 3 : at + 3 + n_keys]))
    return keys
