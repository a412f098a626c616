"""vLLM's disaggregated prefill/decode protocol (kv_transfer_params) between emulated engines."""

from __future__ import annotations

import asyncio
import time
import weakref

import aiohttp
import pytest

from fastroute.emulator import server
from fastroute.emulator.model import EngineConfig
from fastroute.emulator.server import EmulatedFleet, EngineSpec

pytestmark = pytest.mark.integration

PROMPT = "The quick brown fox jumps over the lazy dog. " * 120  # 5400 bytes, 1350 tokens
NIXL_FIELDS = {
    "do_remote_prefill",
    "do_remote_decode",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
}


def _pd_fleet(**prefill_kw) -> EmulatedFleet:
    return EmulatedFleet(
        [
            EngineSpec(name="p0", profile="h100", role="prefill", **prefill_kw),
            EngineSpec(name="d0", profile="h100", role="decode"),
        ]
    )


async def _prefill(s, url, prompt=PROMPT):
    body = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    async with s.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        return await resp.json()


async def _decode(s, url, params, prompt=PROMPT, max_tokens=5):
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "kv_transfer_params": params}  # fmt: skip
    async with s.post(url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.json()


def test_prefill_then_decode_with_transferred_kv(arun):
    """P returns NIXL-style params; D accepts them once, charging transfer instead of prefill."""

    async def main():
        async with _pd_fleet() as fleet:
            p, d = fleet[0], fleet[1]
            async with aiohttp.ClientSession() as s:
                pre = await _prefill(s, p.url)
                params = pre["kv_transfer_params"]
                assert set(params) == NIXL_FIELDS
                assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
                assert params["remote_engine_id"] == p.engine_id
                assert params["remote_port"] == p.port and params["remote_request_id"] == pre["id"]
                assert len(params["remote_block_ids"]) == -(-1350 // 16)
                assert pre["usage"]["completion_tokens"] == 1
                assert p.model.num_held == 1 and p.model.kv.num_used > 0

                status, out = await _decode(s, d.url, params)
                assert status == 200 and out["usage"]["completion_tokens"] == 5
                assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 1349
                assert p.model.num_held == 0 and p.model.kv.num_used == 0
                assert d.model.prefix_cache_hits_total == 0  # nothing came from D's own cache

                status, again = await _decode(s, d.url, params)
                assert status == 400 and "unknown or expired" in again["error"]["message"]
                assert again["error"]["param"] == "kv_transfer_params"

    arun(main())


def test_decode_ttft_is_transfer_time_not_prefill_time(arun):
    """Decoding from transferred KV gets its first token much sooner than a full prefill."""
    prompt = "lorem ipsum dolor sit amet " * 800  # ~5400 tokens

    async def first_token_s(s, url, params):
        body = {"prompt": prompt, "max_tokens": 2, "ignore_eos": True, "stream": True}
        if params:
            body["kv_transfer_params"] = params
        t0 = time.perf_counter()
        async with s.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            await resp.content.readline()
            elapsed = time.perf_counter() - t0
            await resp.read()
        return elapsed

    async def main():
        async with _pd_fleet() as fleet:
            async with aiohttp.ClientSession() as s:
                fresh = await first_token_s(s, fleet[1].url, None)
                params = (await _prefill(s, fleet[0].url, prompt))["kv_transfer_params"]
                transferred = await first_token_s(s, fleet[1].url, params)
        assert transferred < 0.6 * fresh

    arun(main())


def test_bad_or_misrouted_params_are_rejected(arun):
    """Missing fields, wrong roles and mismatched prompts get 400 in vLLM's error shape."""

    async def main():
        async with _pd_fleet() as fleet:
            p, d = fleet[0], fleet[1]
            async with aiohttp.ClientSession() as s:
                status, err = await _decode(s, d.url, {"do_remote_prefill": True})
                assert status == 400 and "remote_engine_id" in err["error"]["message"]
                bogus = {"do_remote_prefill": True, "remote_engine_id": "nope",
                         "remote_request_id": "x", "remote_block_ids": [1],
                         "remote_host": "127.0.0.1", "remote_port": 1}  # fmt: skip
                status, err = await _decode(s, d.url, bogus)
                assert status == 400 and err["error"]["type"] == "BadRequestError"
                status, err = await _decode(s, p.url, bogus)
                assert status == 400 and "prefill engine" in err["error"]["message"]
                body = {
                    "prompt": "x",
                    "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": True},
                }
                async with s.post(d.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 400
                params = (await _prefill(s, p.url))["kv_transfer_params"]
                status, err = await _decode(s, d.url, params, prompt=PROMPT + " extra words")
                assert status == 400 and "prompt tokens" in err["error"]["message"]
                tampered = {**params, "remote_block_ids": params["remote_block_ids"][:-1]}
                status, _ = await _decode(s, d.url, tampered)
                assert status == 400

    arun(main())


def test_expired_transfer_is_rejected(arun, wait_until):
    """KV not claimed within kv_transfer_timeout_s is released; a late decode gets 400."""

    async def main():
        async with _pd_fleet(config=EngineConfig(kv_transfer_timeout_s=0.2)) as fleet:
            p, d = fleet[0], fleet[1]
            async with aiohttp.ClientSession() as s:
                params = (await _prefill(s, p.url))["kv_transfer_params"]
                rid = params["remote_request_id"]
                loop = asyncio.get_running_loop()
                assert p.model.held(rid, loop.time()) is not None
                await wait_until(lambda: p.model.held(rid, loop.time()) is None, timeout=5)
                assert p.model.kv.num_used == 0
                status, err = await _decode(s, d.url, params)
                assert status == 400 and "expired" in err["error"]["message"]

    arun(main())


def test_claim_over_http_when_the_prefill_engine_is_in_another_process(arun, monkeypatch):
    """Without an in-process registry hit, the decode engine claims KV over HTTP."""

    async def main():
        async with _pd_fleet() as fleet:
            p, d = fleet[0], fleet[1]
            # Hide the in-process registry: the decode side must use remote_host:remote_port.
            monkeypatch.setattr(server, "_LOCAL_ENGINES", weakref.WeakValueDictionary())
            async with aiohttp.ClientSession() as s:
                params = (await _prefill(s, p.url))["kv_transfer_params"]
                status, out = await _decode(s, d.url, params)
                assert status == 200 and out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
                assert p.model.num_held == 0
                status, _ = await _decode(s, d.url, params)
                assert status == 400
                dead = {**params, "remote_port": 1}
                status, _ = await _decode(s, d.url, dead)
                assert status == 400

    arun(main())
