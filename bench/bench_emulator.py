"""Engine-emulator figures (not a pytest file): cost per token, and model vs server fidelity.

(a) **Cost.** One ``fastroute engine`` process serves 8 engines (a40 profile);
    this process opens 200 concurrent SSE streams (25 per engine) and counts the
    tokens it receives. Over a steady-state window we read the engine process's
    CPU time from ``/proc/<pid>/stat`` and report CPU µs per emitted token, the
    cores it used, and the per-stream token rate.

(b) **Fidelity.** A fresh single-engine process gets a fixed, seeded workload
    (Poisson arrivals, mixed prompt lengths, fixed output lengths). The client
    measures TTFT and TBOT over HTTP; the same requests, with the client's send
    times as arrivals, are replayed through :class:`~fastroute.emulator.model.EngineModel`
    in virtual time. We report the medians of both and their relative difference.

Run: ``.venv/bin/python bench/bench_emulator.py`` (about 45 s). ``--json PATH``
also writes the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import queue
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import uvloop

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastroute.emulator.model import EngineModel, Request, replay  # noqa: E402
from fastroute.hardware import get_profile  # noqa: E402
from fastroute.tokens import tokenize_text  # noqa: E402

READY = re.compile(r"^engine (\S+) listening on (http://\S+)$")
CLK_TCK = os.sysconf("SC_CLK_TCK")


class EngineProcess:
    """``fastroute engine`` in a subprocess; knows its URLs and CPU time."""

    def __init__(self, *args: str, count: int) -> None:
        cmd = [sys.executable, "-m", "fastroute", "--log-level", "WARNING", "engine",
               "--count", str(count), "--base-port", "0", *args]  # fmt: skip
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        self.urls: list[str] = []
        # A thread reads the pipe: select() cannot see lines already in the text buffer.
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(
            target=lambda: [lines.put(x) for x in self.proc.stdout], daemon=True
        ).start()
        deadline = time.monotonic() + 30
        while len(self.urls) < count:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.close()
                raise RuntimeError("engines did not become ready within 30 s") from None
            match = READY.match(line.strip())
            if not match:
                self.close()
                raise RuntimeError(f"unexpected engine output: {line!r}")
            self.urls.append(match.group(2))

    def cpu_s(self) -> float:
        """User + system CPU seconds of the engine process so far."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()


# -- (a) cost per token ---------------------------------------------------------------------------
@dataclass
class Counter:
    tokens: int = 0
    stream_rates: list[float] = field(default_factory=list)


async def _count_stream(session, url, body, counter: Counter) -> None:
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, resp.status
        first = last = None
        n = 0
        async for line in resp.content:
            if line.startswith(b"data: {"):
                counter.tokens += 1
                n += 1
                last = time.perf_counter()
                if first is None:
                    first = last
    if n > 1:
        counter.stream_rates.append((n - 1) / (last - first))


async def bench_cost(engines: int, streams: int, tokens_per_stream: int, window_s: float) -> dict:
    proc = EngineProcess("--profile", "a40", count=engines)
    try:
        counter = Counter()
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(
            connector=conn, timeout=aiohttp.ClientTimeout(total=None)
        ) as session:
            prompt = "Write a long essay about load balancing. " * 6
            body = {"prompt": prompt, "max_tokens": tokens_per_stream, "ignore_eos": True,
                    "stream": True}  # fmt: skip
            tasks = [
                asyncio.create_task(_count_stream(session, proc.urls[i % engines], body, counter))
                for i in range(streams)
            ]
            await asyncio.sleep(3.0)  # all prefills done; steady decode
            cpu0, tok0, t0 = proc.cpu_s(), counter.tokens, time.perf_counter()
            await asyncio.sleep(window_s)
            cpu1, tok1, t1 = proc.cpu_s(), counter.tokens, time.perf_counter()
            await asyncio.gather(*tasks)
        tokens = tok1 - tok0
        return {
            "engines": engines,
            "streams": streams,
            "window_s": round(t1 - t0, 2),
            "tokens_in_window": tokens,
            "tokens_per_s": round(tokens / (t1 - t0), 1),
            "per_stream_tokens_per_s_median": round(statistics.median(counter.stream_rates), 1),
            "engine_process_cores": round((cpu1 - cpu0) / (t1 - t0), 3),
            "cpu_us_per_token": round((cpu1 - cpu0) / tokens * 1e6, 1),
        }
    finally:
        proc.close()


# -- (b) model vs server --------------------------------------------------------------------------
def _workload(seed: int, n: int, rate_rps: float) -> list[tuple[float, str, int]]:
    rng = random.Random(seed)
    t = 0.0
    out = []
    for i in range(n):
        t += rng.expovariate(rate_rps)
        words = rng.randint(50, 1500)  # 6-byte words: ~75-2250 tokens
        prompt = f"request {i}: " + " ".join(f"w{rng.randint(1000, 9999)}" for _ in range(words))
        out.append((t, prompt, rng.randint(20, 80)))
    return out


async def _timed_stream(session, url, prompt, max_tokens, start_at, t_base) -> tuple:
    await asyncio.sleep(max(0.0, start_at - (time.perf_counter() - t_base)))
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    sent = time.perf_counter()
    times = []
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, resp.status
        async for line in resp.content:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
    return sent - t_base, times


async def bench_fidelity(profile: str, n: int, rate_rps: float, seed: int) -> dict:
    work = _workload(seed, n, rate_rps)
    proc = EngineProcess("--profile", profile, count=1)
    try:
        async with aiohttp.ClientSession() as session:
            t_base = time.perf_counter()
            results = await asyncio.gather(
                *(_timed_stream(session, proc.urls[0], p, m, t, t_base) for t, p, m in work)
            )
    finally:
        proc.close()
    http_ttft = [times[0] - t_base - sent for (sent, times) in results]
    http_tbot = [(times[-1] - times[0]) / (len(times) - 1) for (_, times) in results]

    model = EngineModel(get_profile(profile))
    arrivals = []
    for i, ((sent, _), (_, prompt, max_tokens)) in enumerate(zip(results, work, strict=True)):
        tp = tokenize_text(prompt)
        arrivals.append((sent, Request(f"r{i}", tp.num_tokens, tp.block_hashes,
                                       output_tokens=max_tokens)))  # fmt: skip
    reqs = replay(model, arrivals)
    model_ttft = [r.first_token_s - r.arrival_s for r in reqs]
    model_tbot = [(r.last_token_s - r.first_token_s) / (r.num_output - 1) for r in reqs]

    def summary(http: list[float], mod: list[float]) -> dict:
        h, m = statistics.median(http), statistics.median(mod)
        per_req = [abs(a - b) / b for a, b in zip(http, mod, strict=True)]
        return {
            "http_median_ms": round(h * 1e3, 2),
            "model_median_ms": round(m * 1e3, 2),
            "median_rel_diff_pct": round(abs(h - m) / m * 100, 2),
            "per_request_rel_err_median_pct": round(statistics.median(per_req) * 100, 2),
        }

    return {
        "profile": profile,
        "requests": n,
        "rate_rps": rate_rps,
        "ttft": summary(http_ttft, model_ttft),
        "tbot": summary(http_tbot, model_tbot),
    }


def _machine() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    system = f"{platform.system()} {platform.release()}"
    return f"{os.cpu_count()} vCPU {cpu}, {system}, Python {platform.python_version()}"


async def main(args: argparse.Namespace) -> dict:
    cost = await bench_cost(args.engines, args.streams, args.tokens_per_stream, args.window_s)
    fidelity = await bench_fidelity("a40", args.requests, args.rate_rps, args.seed)
    return {"machine": _machine(), "cost": cost, "fidelity": fidelity}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--tokens-per-stream", type=int, default=650)
    parser.add_argument("--window-s", type=float, default=15.0)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--rate-rps", type=float, default=2.5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    t0 = time.perf_counter()
    result = uvloop.run(main(args))
    result["bench_wall_s"] = round(time.perf_counter() - t0, 1)
    c, f = result["cost"], result["fidelity"]
    print(f"machine: {result['machine']}")
    print(
        f"(a) {c['engines']} engines, {c['streams']} streams: {c['tokens_per_s']} tokens/s "
        f"(median {c['per_stream_tokens_per_s_median']} tokens/s per stream); engine process "
        f"{c['engine_process_cores']} cores, {c['cpu_us_per_token']} CPU µs per token"
    )
    for key in ("ttft", "tbot"):
        s = f[key]
        print(
            f"(b) {key.upper()} median: HTTP {s['http_median_ms']} ms vs model "
            f"{s['model_median_ms']} ms ({s['median_rel_diff_pct']} % apart; per-request "
            f"median error {s['per_request_rel_err_median_pct']} %)"
        )
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
