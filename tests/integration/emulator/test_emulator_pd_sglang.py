"""SGLang's disaggregated prefill/decode protocol (bootstrap rooms) between emulated
engines: the same request to both, the decode waits for the room's prefill."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from fastroute.emulator.model import EngineConfig
from fastroute.emulator.server import EmulatedFleet, EngineSpec

pytestmark = pytest.mark.integration

PROMPT = "The quick brown fox jumps over the lazy dog. " * 120  # 1350 tokens
#: A slow transfer, so a decode that waited for it is measurably later than one that did not.
TRANSFER_LATENCY_S = 0.3


def _fleet(decode_wait_s: float = 5.0) -> EmulatedFleet:
    slow_transfer = EngineConfig(kv_transfer_latency_s=TRANSFER_LATENCY_S)
    return EmulatedFleet(
        [
            EngineSpec(name="p0", profile="h100", role="prefill", kind="sglang"),
            EngineSpec(
                name="d0",
                profile="h100",
                role="decode",
                kind="sglang",
                config=slow_transfer,
                bootstrap_timeout_s=decode_wait_s,
            ),
        ]
    )


def _body(prefill_port: int, room: int | None, **extra) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 5, "ignore_eos": True, **extra}
    if room is not None:
        body.update(bootstrap_host="127.0.0.1", bootstrap_port=prefill_port, bootstrap_room=room)
    return body


async def _post(s, url, body):
    async with s.post(url + "/v1/completions", json=body) as resp:
        if body.get("stream"):
            return resp.status, await resp.text()
        return resp.status, await resp.json()


def test_same_request_to_both_engines_decodes_after_the_prefill(arun):
    """Sent at once, the prefill answers one token and the decode the requested five,
    no earlier than the KV transfer after the prefill; the KV is taken (none held)."""

    async def main():
        async with _fleet() as fleet, aiohttp.ClientSession() as s:
            p, d = fleet[0], fleet[1]
            assert p.bootstrap_port is not None and p.bootstrap_port != p.port
            body = _body(p.bootstrap_port, room=2**62 + 7)
            started = time.perf_counter()
            (p_status, p_out), (d_status, d_out) = await asyncio.gather(
                _post(s, p.url, body), _post(s, d.url, body)
            )
            took = time.perf_counter() - started
            assert (p_status, d_status) == (200, 200), (p_out, d_out)
            assert p_out["usage"]["completion_tokens"] == 1
            assert d_out["usage"]["completion_tokens"] == 5
            assert "kv_transfer_params" not in p_out or p_out["kv_transfer_params"] is None
            assert took >= TRANSFER_LATENCY_S
            assert p.model.num_held == 0 and len(p.rooms) == 0
            assert d.model.num_running == 0

    arun(main())


def test_streamed_prefill_and_decode(arun):
    """``stream: true`` in the shared body: both answer SSE, the prefill one token."""

    async def main():
        async with _fleet() as fleet, aiohttp.ClientSession() as s:
            p, d = fleet[0], fleet[1]
            body = _body(p.bootstrap_port, room=11, stream=True)
            (p_status, p_text), (d_status, d_text) = await asyncio.gather(
                _post(s, p.url, body), _post(s, d.url, body)
            )
            assert (p_status, d_status) == (200, 200)
            assert p_text.endswith("data: [DONE]\n\n") and d_text.endswith("data: [DONE]\n\n")
            assert d_text.count('"text":') > p_text.count('"text":') >= 1

    arun(main())


def test_requests_without_a_room_get_400_in_sglangs_flat_shape(arun):
    async def main():
        async with _fleet() as fleet, aiohttp.ClientSession() as s:
            for engine in fleet.engines:
                status, out = await _post(s, engine.url, _body(0, room=None))
                assert status == 400
                assert out["object"] == "error" and "error" not in out
                assert out["param"] == "bootstrap_room" and "bootstrap_room" in out["message"]

    arun(main())


def test_decode_without_its_prefill_times_out_cleanly(arun):
    """No prefill ever runs for the room: the decode answers 500 after its wait, and
    neither engine keeps anything for the room."""

    async def main():
        async with _fleet(decode_wait_s=0.3) as fleet, aiohttp.ClientSession() as s:
            p, d = fleet[0], fleet[1]
            started = time.perf_counter()
            status, out = await _post(s, d.url, _body(p.bootstrap_port, room=5))
            assert 0.3 <= time.perf_counter() - started < 3.0
            assert status == 500
            assert "bootstrap_room 5" in out["message"] and "0.3 s" in out["message"]
            assert len(p.rooms) == 0 and d.model.num_waiting == 0 and d.model.num_running == 0
            # a bootstrap port nobody listens on: a clean 500 too, not a hang
            status, out = await _post(s, d.url, _body(1, room=6))
            assert status == 500 and "bootstrap server" in out["message"]

    arun(main())
