"""Bounded under overload: 130 % of the fleet's capacity for 5 minutes, two priorities.

    PYTHONPATH=. .venv/bin/python bench/bench_overload.py [--load 1.3] [--duration-s 300]
        [--out bench-results/overload]

The chaos run's fleet (:mod:`fastroute.fleetbench.chaos`, no faults): 4 emulated H100 engines,
each limited to ``--max-num-seqs`` concurrent sequences so that its capacity is small and
known. The capacity is the emulator's own saturation rate for the request shape
(:func:`fastroute.emulator.saturation.saturation_capacity_rps`), written into the config as
each engine's ``capacity_rps``, so the controller plans with the true figure. Two classes:
``interactive`` (TTFT SLO 2 s) and ``batch`` (TTFT SLO 30 s). An open-loop Poisson client
offers ``--load`` × capacity, half of each priority (``x-fastroute-priority``), with no
retries. It measures each request's status, its TTFT (first content token) and its end.

Every 5 s it samples the proxy's processes (RSS, fds, the answering worker's
``fastroute_proxy_in_flight``) and each engine's ``vllm:num_requests_waiting``. The report
has, per priority: offered, admitted, shed (429/503), other errors, and the TTFT p50/p99 of
the admitted with their SLO attainment. Then each sampled series' maximum against its bound:
``limits.max_concurrent_requests`` per worker, the emulator's ``--max-waiting``. Also the RSS
slope (:func:`fastroute.fleetbench.soak.leak_report`). Not a test: figures for
docs/failure-handling.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path

import aiohttp

from fastroute.emulator.model import EngineConfig
from fastroute.emulator.saturation import saturation_capacity_rps
from fastroute.fleetbench.chaos import MODEL, ChaosOptions, ChaosRun, FleetShape
from fastroute.fleetbench.soak import ResourceSample, leak_report, sample_forever
from fastroute.hardware import get_profile

#: Prompt and output tokens of every request (the rendered prompt is about 40 tokens).
PROMPT_TOKENS, OUTPUT_TOKENS = 40, 160
#: Most requests the client holds open at once (an open loop must still be bounded);
#: arrivals beyond it are counted as ``client_dropped``, never silently skipped.
MAX_CLIENT_IN_FLIGHT = 2000
#: The classes: interactive is what the SLO figure is about, batch is what may be shed.
CLASSES = """
[[classes]]
name = "interactive"
model = "*"
priority = "interactive"
ttft_slo_s = 2.0
tbot_slo_s = 0.2

[[classes]]
name = "batch"
model = "*"
priority = "batch"
ttft_slo_s = 30.0
tbot_slo_s = 1.0
"""
SLO_TTFT_S = {"interactive": 2.0, "batch": 30.0}


async def _one(http: aiohttp.ClientSession, url: str, i: int, priority: str, t0: float) -> dict:
    body = {
        "model": MODEL, "stream": True, "max_tokens": OUTPUT_TOKENS,
        "messages": [{"role": "user", "content": f"overload request {i}"}],
    }  # fmt: skip
    start = time.monotonic()
    out = {"priority": priority, "start_s": start - t0, "status": 0, "ttft_s": None}
    try:
        headers = {"x-fastroute-priority": priority}
        async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
            out["status"] = resp.status
            async for line in resp.content:
                if out["ttft_s"] is None and b'"content":"' in line and b'"content":""' not in line:
                    out["ttft_s"] = time.monotonic() - start
    except (aiohttp.ClientError, TimeoutError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:120]
    out["end_s"] = time.monotonic() - t0
    return out


async def _offer(url: str, rate_rps: float, duration_s: float, seed: int) -> tuple[list, int]:
    rng = random.Random(seed)
    results: list[dict] = []
    pending: set[asyncio.Task] = set()
    dropped, t0, t, i = 0, time.monotonic(), 0.0, 0
    limits = aiohttp.TCPConnector(limit=MAX_CLIENT_IN_FLIGHT)
    async with aiohttp.ClientSession(
        connector=limits, timeout=aiohttp.ClientTimeout(total=180.0)
    ) as http:
        while True:
            t += rng.expovariate(rate_rps)
            if t >= duration_s:
                break
            await asyncio.sleep(max(0.0, t0 + t - time.monotonic()))
            if len(pending) >= MAX_CLIENT_IN_FLIGHT:
                dropped += 1
                continue
            priority = "interactive" if rng.random() < 0.5 else "batch"
            task = asyncio.create_task(_one(http, url, i, priority, t0))
            task.add_done_callback(lambda done: results.append(done.result()))
            task.add_done_callback(pending.discard)
            pending.add(task)
            i += 1
        await asyncio.gather(*pending)
    return results, dropped


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _per_priority(results: list[dict]) -> dict[str, dict]:
    out = {}
    for priority in ("interactive", "batch"):
        rows = [r for r in results if r["priority"] == priority]
        counts = Counter(
            "admitted" if r["status"] == 200 else
            "shed" if r["status"] in (429, 503) else "other"
            for r in rows
        )  # fmt: skip
        ttfts = [r["ttft_s"] for r in rows if r["status"] == 200 and r["ttft_s"] is not None]
        met = sum(t <= SLO_TTFT_S[priority] for t in ttfts)
        out[priority] = {
            "offered": len(rows), **counts, "ttft_p50_s": _quantile(ttfts, 0.5),
            "ttft_p99_s": _quantile(ttfts, 0.99), "slo_met_of_admitted": met / max(1, len(ttfts)),
        }  # fmt: skip
    return out


def _maxima(samples: list[ResourceSample]) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in samples:
        key = f"{s.role}:{s.resource}"
        out[key] = max(out.get(key, 0.0), s.value)
    return out


async def _plan(controller_url: str) -> object:
    """The controller's plan (``/v1/plan``): per class demand, allocation and shed fraction."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10.0)) as http:
        async with http.get(controller_url + "/v1/plan") as resp:
            return await resp.json()


async def main(args: argparse.Namespace) -> dict:
    per_engine = saturation_capacity_rps(
        get_profile("h100"), EngineConfig(max_num_seqs=args.max_num_seqs),
        [(PROMPT_TOKENS, OUTPUT_TOKENS)] * 400,
    )  # fmt: skip
    shape = FleetShape(
        capacity_rps=round(per_engine, 3), extra_toml=CLASSES,
        engine_args=("--max-num-seqs", str(args.max_num_seqs)),
    )  # fmt: skip
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    run = ChaosRun(ChaosOptions(duration_s=args.duration_s, kinds=()), out_dir, shape=shape)
    samples: list[ResourceSample] = []
    with run.procs:
        await run.start()
        gauges = [("proxy-worker", 0, run.proxy_url, "fastroute_proxy_in_flight")]
        gauges += [(f"engine-e{k}", 0, run._engine_url(k), "vllm:num_requests_waiting")
                   for k in range(run.options.engines)]  # fmt: skip
        t0 = time.monotonic()
        sampler = asyncio.create_task(sample_forever(run.pids, lambda: gauges, samples, t0, 5.0))
        rate = args.load * per_engine * run.options.engines
        offer = asyncio.create_task(_offer(run.proxy_url, rate, args.duration_s, args.seed))
        await asyncio.sleep(args.duration_s * 0.8)
        plan = await _plan(run.controller_url)  # what the controller decided, under load
        results, dropped = await offer
        sampler.cancel()
    report = {
        "capacity_rps_per_engine": per_engine, "offered_rps": rate, "load": args.load,
        "duration_s": args.duration_s, "client_dropped": dropped,
        "per_priority": _per_priority(results), "maxima": _maxima(samples), "plan": plan,
        "rss_slopes": [r for r in leak_report(samples, args.duration_s)
                       if r["resource"] == "rss_bytes"],
    }  # fmt: skip
    (out_dir / "overload.json").write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", type=float, default=1.3, help="offered / capacity (1.3)")
    parser.add_argument("--duration-s", type=float, default=300.0, help="default 300")
    parser.add_argument("--max-num-seqs", type=int, default=4, help="per engine (default 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-results/overload")
    print(json.dumps(asyncio.run(main(parser.parse_args())), indent=1))
