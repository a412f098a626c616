"""Measure how real vLLM streams, and what today's proxy makes of it (prints JSON lines).

    PYTHONPATH=. python tests/real/measure_streams.py [--tokens 64] [--runs 3]

Starts one vLLM engine (both cores; or uses ``--engine URL``) and ``fastroute serve`` in
front, then for each per-request ``stream_interval`` (1 and 4) and each usage option streams
``--tokens`` pinned tokens directly and through the proxy. Per case it prints the events
carrying text, tokens per event (from ``continuous_usage_stats``), the engine's
``usage.completion_tokens``, the true time between output tokens (client-side span /
(completion_tokens - 1)) and the proxy's ``tbot_s`` (its decision record) with their ratio.
Last, it kills the engine's core process mid-stream through the proxy and prints the events
the client saw after the last token.
Not a test: numbers for docs/real-engines.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import real_harness as rh

PROMPT = "hello world"


def _stream(url: str, body: dict[str, Any]) -> tuple[list[tuple[float, dict[str, Any]]], str]:
    """POST a streamed request; the (arrival time, event) list and the x-request-id."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    events: list[tuple[float, dict[str, Any]]] = []
    with urllib.request.urlopen(req, timeout=120) as resp:
        rid = resp.headers.get("x-request-id", "")
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            payload = line[6:]
            now = time.perf_counter()
            events.append((now, {"done": True} if payload == b"[DONE]" else json.loads(payload)))
    return events, rid


def _decision(proxy_url: str, rid: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{proxy_url}/admin/decisions/{rid}", timeout=10) as resp:
        return json.loads(resp.read())


def _case(base: str, proxy: str | None, interval: int, usage: str, tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": rh.MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_interval": interval,
    }
    if usage != "none":
        body["stream_options"] = {
            "include_usage": True,
            "continuous_usage_stats": usage == "continuous",
        }
    events, rid = _stream((proxy or base) + "/v1/chat/completions", body)
    text_events = [
        (t, e) for t, e in events if e.get("choices") and e["choices"][0]["delta"].get("content")
    ]
    per_event = []
    last_count = 0
    for _, e in events:
        if e.get("choices") and e.get("usage"):
            count = e["usage"]["completion_tokens"]
            if count > last_count:
                per_event.append(count - last_count)
            last_count = count
    final_usage = next(
        (e["usage"] for _, e in events if e.get("usage") and not e.get("choices")), None
    )
    completion_tokens = final_usage["completion_tokens"] if final_usage else tokens
    span_s = text_events[-1][0] - text_events[0][0]
    true_tbot_s = span_s / (completion_tokens - 1)
    out: dict[str, Any] = {
        "via": "proxy" if proxy else "engine",
        "stream_interval": interval,
        "usage": usage,
        "events": len(events),
        "text_events": len(text_events),
        "tokens_per_event": per_event or None,
        "usage_chunk_seen": final_usage is not None,
        "completion_tokens": completion_tokens,
        "true_tbot_ms": round(true_tbot_s * 1e3, 2),
    }
    if proxy:
        tbot = _decision(proxy, rid).get("timings", {}).get("tbot_s")
        out["proxy_tbot_ms"] = None if tbot is None else round(tbot * 1e3, 2)
        out["proxy_over_true"] = None if tbot is None else round(tbot / true_tbot_s, 2)
    return out


def _engine_core_pid(api_server_pid: int) -> int:
    """The engine's core process: a child of the API server."""
    out = subprocess.run(
        ["pgrep", "-P", str(api_server_pid)], capture_output=True, text=True, check=False
    )
    for pid in out.stdout.split():
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"EngineCore" in f.read():
                return int(pid)
    raise RuntimeError("no engine core process")


def _in_stream_error(api_server_pid: int, proxy: rh.Running) -> dict[str, Any]:
    body = {
        "model": rh.MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 900,
        "ignore_eos": True,
        "stream": True,
    }
    req = urllib.request.Request(
        proxy.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    tail: list[str] = []
    with urllib.request.urlopen(req, timeout=120) as resp:
        for i, raw in enumerate(resp):
            line = raw.decode().strip()
            if line:
                tail = (tail + [line])[-3:]
            if i == 40:
                os.kill(_engine_core_pid(api_server_pid), signal.SIGKILL)
    return {"via": "proxy", "in_stream_error_last_events": tail}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--engine", help="a running engine's URL (default: start one)")
    parser.add_argument("--engine-pid", type=int, help="its API server's pid (to kill its core)")
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="fastroute-measure-"))
    if args.engine:
        engine = rh.Running(None, args.engine, run_dir / "given.log")
    else:
        engine = rh.start_vllm(rh.installed(), run_dir, name="vllm-measure", cpu="0-1")
    pid = args.engine_pid if args.engine else engine.proc.pid  # type: ignore[union-attr]
    runs = [engine]
    try:
        print(json.dumps({"engine_ready_s": round(rh.wait_ready([engine], "/health"), 1)}))
        proxy = rh.start_proxy(rh.write_config([engine.url], run_dir, controller=False), run_dir)
        runs.append(proxy)
        rh.wait_ready([proxy], "/ready", timeout_s=60)
        for interval in (1, 4):
            for usage in ("none", "final", "continuous"):
                for via in (None, proxy.url):
                    for _ in range(args.runs):
                        print(json.dumps(_case(engine.url, via, interval, usage, args.tokens)))
        if pid is not None:
            print(json.dumps(_in_stream_error(pid, proxy)))
    finally:
        rh.stop(runs)


if __name__ == "__main__":
    main()
