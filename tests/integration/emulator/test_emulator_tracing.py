"""``fastroute engine --otlp-traces-endpoint``: the engine's ``llm_request`` span, a child of
the request's ``traceparent``, exported over OTLP/HTTP (as vLLM's flag of the same name)."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from fastroute.emulator.tracing import ENGINE_SPAN_NAME
from fastroute.testing.otlp import serve_otlp_receiver

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
READY = re.compile(r"^engine (\S+) listening on (http://127\.0\.0\.1:\d+)$")
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def test_engine_exports_its_span_under_the_callers_traceparent() -> None:
    async def main() -> None:
        async with serve_otlp_receiver() as (endpoint, receiver):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "fastroute", "--log-level", "WARNING", "engine",
                "--count", "1", "--base-port", "0", "--model", "m",
                "--otlp-traces-endpoint", endpoint,
                cwd=ROOT, stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
            try:
                assert proc.stdout is not None
                line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().strip()
                match = READY.match(line)
                assert match, line
                body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 2}  # fmt: skip
                headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "x-request-id": "r-1"}
                async with aiohttp.ClientSession() as s:
                    url = match.group(2) + "/v1/chat/completions"
                    async with s.post(url, json=body, headers=headers) as resp:
                        assert resp.status == 200
                proc.send_signal(signal.SIGTERM)  # the exit flushes the batch processor
                assert await asyncio.wait_for(proc.wait(), 15) == 0
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
        (span,) = receiver.spans
        assert span.name == ENGINE_SPAN_NAME and span.service == "fastroute-engine"
        assert (span.trace_id, span.parent_span_id) == (TRACE_ID, PARENT_ID)
        assert span.attributes["gen_ai.request.id"] == "r-1"
        assert span.attributes["http.response.status_code"] == 200

    asyncio.run(asyncio.wait_for(main(), 60))
