"""The load driver's SSE reader: which events are tokens, and when the first one came."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web

from fastroute.loadgen.client import route_reason, send_chat
from fastroute.loadgen.records import RequestRecord
from fastroute.testing.servers import serve_app

GAP_S = 0.2


def _event(delta: dict[str, Any]) -> bytes:
    chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


async def _reasoning_then_content(request: web.Request) -> web.StreamResponse:
    """A reasoning model's stream: role, two reasoning deltas (vLLM's and SGLang's field), a
    pause, two content deltas, an empty final delta, ``[DONE]``."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(_event({"role": "assistant", "content": ""}))
    await resp.write(_event({"reasoning": "let me think"}))
    await resp.write(_event({"reasoning_content": " some more"}))
    await asyncio.sleep(GAP_S)
    await resp.write(_event({"content": "Hello"}) + _event({"content": " there"}))
    await resp.write(_event({"content": ""}) + b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def test_reasoning_deltas_are_tokens_and_start_the_ttft() -> None:
    async def main() -> RequestRecord:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", _reasoning_then_content)
        async with serve_app(app) as url, aiohttp.ClientSession() as http:
            record = RequestRecord(
                session_id="s", tenant="t", source="c", model="m", turn=0, sent_at_s=0.0
            )
            reply = await send_chat(http, url + "/v1/chat/completions", b"{}", record)
            assert reply.text == "Hello there"  # the next turn sees the answer, not the thoughts
            return record

    record = asyncio.run(asyncio.wait_for(main(), 10.0))
    assert record.error is None
    assert record.output_tokens == 4  # two reasoning + two content events
    assert record.ttft_s is not None and record.ttft_s < GAP_S  # the first reasoning delta
    assert record.max_gap_s is not None and record.max_gap_s >= GAP_S * 0.9
    assert record.tbot_s is not None and record.tbot_s >= GAP_S / 3 * 0.9


async def _decided(request: web.Request) -> web.Response:
    """A JSON reply carrying fastroute's decision headers."""
    headers = {
        "x-fastroute-engine": "e1",
        "x-fastroute-decision": "policy=prefix-hrw;reason=cost-spill;rank=0;attempt=1",
    }
    body = {"choices": [{"message": {"content": "ok"}}], "usage": {"completion_tokens": 1}}
    return web.json_response(body, headers=headers)


def test_the_record_keeps_the_decision_reason() -> None:
    async def main() -> RequestRecord:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", _decided)
        async with serve_app(app) as url, aiohttp.ClientSession() as http:
            record = RequestRecord(
                session_id="s",
                tenant="t",
                source="c",
                model="m",
                turn=0,
                sent_at_s=0.0,
                stream=False,
            )
            await send_chat(http, url + "/v1/chat/completions", b"{}", record)
            return record

    record = asyncio.run(asyncio.wait_for(main(), 10.0))
    assert (record.engine, record.route_reason) == ("e1", "cost-spill")


def test_route_reason_reads_only_the_reason_field() -> None:
    assert route_reason("policy=p;reason=prefix-home;rank=0") == "prefix-home"
    assert route_reason("policy=p;rank=0") is None
    assert route_reason("reason=") is None
    assert route_reason(None) is None
