"""Process lifecycle: graceful drain, and ``fastroute serve`` as a real process."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import aiohttp
import pytest
from proxy_harness import Harness

pytestmark = pytest.mark.integration


def test_proxy_drain_lets_streams_finish(h: Harness) -> None:
    """On shutdown the listener closes, /health state flips, and an open stream completes."""

    async def main() -> None:
        async with h.proxy_stack(1) as st:
            await st.fleet[0].set_faults(slowdown=5.0)
            body = h.chat_body("drain me", stream=True, max_tokens=12, ignore_eos=True)
            async with aiohttp.ClientSession() as s:
                async with s.post(st.url + "/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200
                    first = await asyncio.wait_for(resp.content.readline(), 5.0)
                    assert first.startswith(b"data: ")
                    drain = asyncio.create_task(st.drain())
                    await h.wait_until(lambda: st.ctx.draining, timeout=5.0)
                    with pytest.raises(aiohttp.ClientConnectionError):
                        async with s.get(st.url + "/health"):
                            pass
                    events, done = await h.read_sse(resp)
                await asyncio.wait_for(drain, 10.0)
            assert done and not any("error" in e for e in events)

    h.run(main())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_proxy_serve_cli_ready_then_sigterm(tmp_path: Path) -> None:
    """`fastroute serve` comes up ready on uvloop and exits 0 on SIGTERM."""
    config = tmp_path / "fastroute.toml"
    config.write_text(
        '[[engines]]\nname = "e0"\nurl = "http://127.0.0.1:9"\nmodels = ["m"]\n'
        f'[proxy]\ntable_name = "fastroute-test-absent-{uuid.uuid4().hex[:12]}"\n'
    )
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastroute", "serve", "--config", str(config), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        deadline = time.monotonic() + 15.0
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as r:
                    assert r.status == 200
                    break
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                assert time.monotonic() < deadline, "proxy not ready within 15 s"
                time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
        if proc.stderr:
            proc.stderr.close()
