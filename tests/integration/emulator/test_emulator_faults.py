"""Every fault knob behaves as documented, set live over /admin/fault (or at start)."""

from __future__ import annotations

import asyncio
import time
from unittest import mock

import aiohttp
import pytest
from aiohttp.test_utils import make_mocked_request

from fastroute.emulator.faults import FaultState
from fastroute.emulator.server import EmulatedEngine, EmulatedFleet, EngineSpec

pytestmark = pytest.mark.integration

FIXED = {"prompt": "fault test", "max_tokens": 15, "ignore_eos": True}


async def _post_fault(s, url, **changes):
    async with s.post(url + "/admin/fault", json=changes) as resp:
        return resp.status, await resp.json()


async def _timed(s, url, body=FIXED):
    t0 = time.perf_counter()
    async with s.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        await resp.read()
    return time.perf_counter() - t0


def test_slowdown_stretches_step_times(arun, scrape):
    """slowdown=4 makes the same request several times slower and shows in /metrics."""

    async def main():
        async with EmulatedFleet([EngineSpec(profile="h100")]) as fleet:
            url = fleet.urls[0]
            async with aiohttp.ClientSession() as s:
                base = min([await _timed(s, url) for _ in range(2)])
                status, state = await _post_fault(s, url, slowdown=4.0)
                assert status == 200 and state["slowdown"] == 4.0
                slow = min([await _timed(s, url) for _ in range(2)])
                m = await scrape(s, url)
                assert m["fastroute_emulator_fault_active{kind=slowdown}"] == 1
                assert m["fastroute_emulator_slowdown"] == 4.0
        assert slow > 2.5 * base

    arun(main())


def test_error_rate_answers_with_the_chosen_status(arun, scrape):
    """error_rate=1 fails every request with error_status in vLLM's shape; 0.5 fails some."""

    async def main():
        async with EmulatedFleet([EngineSpec(profile="h100", seed=11)]) as fleet:
            url = fleet.urls[0]
            async with aiohttp.ClientSession() as s:
                for status in (500, 503, 429):
                    await _post_fault(s, url, error_rate=1.0, error_status=status)
                    async with s.post(url + "/v1/completions", json=FIXED) as resp:
                        assert resp.status == status
                        err = (await resp.json())["error"]
                        assert err["code"] == status and "injected" in err["message"]
                        assert (resp.headers.get("Retry-After") == "1") == (status == 429)
                await _post_fault(s, url, error_rate=0.5, error_status=503)
                statuses = []
                for _ in range(30):
                    async with s.post(
                        url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}
                    ) as resp:
                        statuses.append(resp.status)
                m = await scrape(s, url)
        assert 0 < statuses.count(503) < 30 and statuses.count(200) == 30 - statuses.count(503)
        assert m["fastroute_emulator_faults_injected_total{kind=error}"] == 3 + statuses.count(503)
        assert m["fastroute_emulator_fault_active{kind=error}"] == 1

    arun(main())


def test_hang_accepts_and_never_answers(arun, wait_until):
    """A hung request gets no response; health still answers; clearing serves new requests."""

    async def main():
        async with EmulatedFleet([EngineSpec(profile="h100")]) as fleet:
            engine = fleet[0]
            async with aiohttp.ClientSession() as s:
                await _post_fault(s, engine.url, hang=True)
                with pytest.raises(asyncio.TimeoutError):
                    async with s.post(
                        engine.url + "/v1/completions", json=FIXED,
                        timeout=aiohttp.ClientTimeout(total=0.3),
                    ) as resp:  # fmt: skip
                        await resp.read()
                async with s.get(engine.url + "/health") as resp:
                    assert resp.status == 200
                # A hung request still in flight must not delay shutdown.
                pending = asyncio.create_task(s.post(engine.url + "/v1/completions", json=FIXED))
                await wait_until(lambda: len(engine._hung) == 1, timeout=5)
                async with s.delete(engine.url + "/admin/fault") as resp:
                    assert (await resp.json())["hang"] is False
                assert await _timed(s, engine.url) < 5
                assert engine.faults.injected_total["hang"] == 2
            t0 = time.perf_counter()
            await engine.stop()
            assert time.perf_counter() - t0 < 3
            with pytest.raises(aiohttp.ClientError):
                await pending

    arun(main())


def test_crash_closes_the_connection_after_k_tokens(arun, read_sse, wait_until):
    """crash_after_tokens=3: a stream delivers 3 tokens then breaks; JSON gets no response."""

    async def main():
        faults = FaultState(crash_after_tokens=3)
        async with EmulatedFleet([EngineSpec(profile="h100", faults=faults)]) as fleet:
            engine = fleet[0]
            async with aiohttp.ClientSession() as s:
                body = {**FIXED, "stream": True}
                got = []
                with pytest.raises(aiohttp.ClientPayloadError):
                    async with s.post(engine.url + "/v1/completions", json=body) as resp:
                        assert resp.status == 200
                        async for line in resp.content:
                            if line.startswith(b"data: "):
                                got.append(line)
                assert len(got) == 3 and b"[DONE]" not in b"".join(got)
                with pytest.raises(aiohttp.ClientError):
                    async with s.post(engine.url + "/v1/completions", json=FIXED) as resp:
                        await resp.read()
                await wait_until(lambda: engine.model.num_running == 0, timeout=5)
                assert engine.faults.injected_total["crash"] == 2
                assert engine.model.kv.num_used == 0

    arun(main())


def test_refuse_connections_closes_and_reopens_the_listener(arun, wait_until):
    """refuse_connections closes the port (connect fails) and reopens it after refuse_for_s."""

    async def main():
        async with EmulatedFleet([EngineSpec(profile="h100")]) as fleet:
            engine = fleet[0]
            url = engine.url
            async with aiohttp.ClientSession() as s:
                status, body = await _post_fault(s, url, refuse_connections=True)
                assert status == 400 and "refuse_for_s" in body["error"]["message"]
                status, _ = await _post_fault(s, url, refuse_connections=True, refuse_for_s=0.5)
                assert status == 200
            assert not engine.listening

            async def health() -> int | None:
                conn = aiohttp.TCPConnector(force_close=True)
                async with aiohttp.ClientSession(connector=conn) as fresh:
                    try:
                        async with fresh.get(url + "/health") as resp:
                            return resp.status
                    except aiohttp.ClientConnectorError:
                        return None

            assert await health() is None
            await wait_until(lambda: engine.listening, timeout=5)
            assert await health() == 200
            assert engine.url == url  # same port
            assert engine.faults.state.refuse_connections is False

    arun(main())


def test_slow_metrics_delays_only_metrics(arun):
    """metrics_delay_s delays /metrics (a short scrape timeout fires) but not /health."""

    async def main():
        async with EmulatedFleet([EngineSpec(profile="h100")]) as fleet:
            url = fleet.urls[0]
            async with aiohttp.ClientSession() as s:
                await _post_fault(s, url, metrics_delay_s=0.4)
                with pytest.raises(asyncio.TimeoutError):
                    async with s.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=0.1)):
                        pass
                t0 = time.perf_counter()
                async with s.get(url + "/metrics") as resp:
                    text = await resp.text()
                assert time.perf_counter() - t0 >= 0.4
                assert 'fastroute_emulator_fault_active{kind="metrics_delay"} 1.0' in text
                async with s.get(url + "/health") as resp:
                    assert resp.status == 200

    arun(main())


def test_drain_refuses_new_work_and_finishes_in_flight(arun, read_sse):
    """drain: /health 503, new requests 503, the stream already running completes."""

    async def main():
        async with EmulatedFleet([EngineSpec(profile="h100")]) as fleet:
            url = fleet.urls[0]
            async with aiohttp.ClientSession() as s:
                body = {"prompt": "long", "max_tokens": 40, "ignore_eos": True, "stream": True}
                resp = await s.post(url + "/v1/completions", json=body)
                await resp.content.readline()
                await _post_fault(s, url, drain=True)
                async with s.get(url + "/health") as h:
                    assert h.status == 503
                async with s.post(url + "/v1/completions", json=FIXED) as r2:
                    assert r2.status == 503
                    assert (await r2.json())["error"]["type"] == "ServiceUnavailableError"
                events, _, done = await read_sse(resp)
                resp.release()
                assert done and events[-1]["choices"][0]["finish_reason"] == "length"
                async with s.get(url + "/admin/fault") as g:
                    assert (await g.json())["drain"] is True

    arun(main())


def test_health_is_503_while_loading(arun, wait_until):
    """load_time_s keeps /health (and requests) at 503 until the model is 'loaded'."""

    async def main():
        async with EmulatedFleet([EngineSpec(profile="h100", load_time_s=0.3)]) as fleet:
            url = fleet.urls[0]
            async with aiohttp.ClientSession() as s:
                async with s.get(url + "/health") as resp:
                    assert resp.status == 503
                async with s.post(url + "/v1/completions", json=FIXED) as resp:
                    assert resp.status == 503

                async def healthy():
                    async with s.get(url + "/health") as resp:
                        return resp.status == 200

                await wait_until(healthy, timeout=5)

    arun(main())


def test_admin_endpoints_refuse_non_loopback_clients(arun):
    """/admin/fault answers 403 to a peer that is not 127.0.0.1 or ::1."""

    async def main():
        engine = EmulatedEngine(EngineSpec(profile="h100"))
        transport = mock.Mock()
        transport.get_extra_info.side_effect = lambda key, default=None: (
            ("10.1.2.3", 4567) if key == "peername" else default
        )
        for method, handler in (("GET", engine._get_fault), ("DELETE", engine._delete_fault)):
            request = make_mocked_request(method, "/admin/fault", transport=transport)
            assert request.remote == "10.1.2.3"
            resp = await handler(request)
            assert resp.status == 403
        assert engine.faults.state == FaultState()

    arun(main())


def test_lying_metrics_claim_an_idle_engine_while_it_serves(arun):
    """metrics_lie: running, waiting and KV usage read 0 while a stream runs; cleared, true."""

    async def main():
        async with EmulatedFleet([EngineSpec(profile="h100")]) as fleet:
            url, engine = fleet.urls[0], fleet.engines[0]
            body = {"model": engine.spec.model_name, "stream": True, "max_tokens": 400,
                    "messages": [{"role": "user", "content": "hello"}]}  # fmt: skip

            def running(text: str) -> float:
                line = next(
                    x for x in text.splitlines() if x.startswith("vllm:num_requests_running")
                )
                return float(line.rsplit(" ", 1)[1])

            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/v1/chat/completions", json=body) as stream:
                    await stream.content.readline()  # the stream is running
                    async with s.get(url + "/metrics") as resp:
                        assert running(await resp.text()) == 1.0
                    await _post_fault(s, url, metrics_lie=True)
                    async with s.get(url + "/metrics") as resp:
                        text = await resp.text()
                    assert running(text) == 0.0
                    assert 'fastroute_emulator_fault_active{kind="metrics_lie"} 1.0' in text
                    async with s.delete(url + "/admin/fault"):
                        pass
                    async with s.get(url + "/metrics") as resp:
                        assert running(await resp.text()) == 1.0

    arun(main())
