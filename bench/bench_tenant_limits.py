"""Fleet-wide tenant limit: two proxies, one controller, emulated engines (real processes).

Tenant ``a`` has 600 requests/min fleet-wide and offers 2× that, split 80/20 between the
us-east and eu-west proxies; tenant ``b`` (no limit) sends a steady trickle. The
controller water-fills ``a``'s limit over the proxies by their reported demand; the
benchmark counts ``a``'s admitted requests (200s) per minute over the measurement window.

Acceptance (issue: fleet-wide limits): 600 ± 3 % per minute. What per-proxy enforcement
without the controller would admit at this demand is derived from the same demand split
(printed; not a measured run): ``proxy_count = 2`` gives each proxy 300, LiteLLM-style
per-replica limits give each proxy the full 600.

Run: ``nice -n 5 python bench/bench_tenant_limits.py`` (≈6 min: start-up, ``--warmup-s``
45 s, ``--measure-s`` 300 s). ``--measure-s 60`` for a quick look.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp

from fastroute.demo.scenario import DEMO_FLEET, MODELS, SLO_S, SOURCES
from fastroute.fleetbench.process import ProcessSet
from fastroute.fleetbench.stack import FastrouteStack, remove_segments, run_prefix, start_fleet

LIMIT_RPM = 600
TENANTS = f"""
[[tenants]]
name = "a"
api_keys = ["sk-tenant-a"]
requests_per_min = {LIMIT_RPM}

[[tenants]]
name = "b"
api_keys = ["sk-tenant-b"]
"""
#: Bound on requests in flight per (proxy, tenant) stream; beyond it a tick is skipped.
MAX_IN_FLIGHT = 64


def _edit(text: str) -> str:
    # Before the first table each proxy enforces the limit / proxy_count.
    return text.replace("[proxy]\n", "[proxy]\nproxy_count = 2\n", 1) + TENANTS


async def _stream(
    s: aiohttp.ClientSession, url: str, key: str, rate_rps: float, until: float, log: list
) -> None:
    """Open-loop requests at ``rate_rps`` until ``until``; appends (t_sent, status)."""
    sem = asyncio.Semaphore(MAX_IN_FLIGHT)
    body = {
        "model": MODELS[0],
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
    }
    headers = {"Authorization": f"Bearer {key}"}

    async def one(t: float, i: int) -> None:
        # A distinct prompt per request: shedding is sticky per routing key.
        # Both models in turn: the limit is the tenant's over every model, and halving
        # each class's load keeps the LP from shedding (this measures limits, not sheds).
        req = {
            **body,
            "model": MODELS[i % 2],
            "messages": [{"role": "user", "content": f"hello {key} {i}"}],
        }
        try:
            async with s.post(url + "/v1/chat/completions", json=req, headers=headers) as r:
                data = await r.read()
                code = ""
                if r.status == 429:  # which 429: the tenant's limit or a shed
                    with contextlib.suppress(ValueError, KeyError, TypeError):
                        code = json.loads(data)["error"]["code"]
                log.append((t, r.status, code))
        except (TimeoutError, aiohttp.ClientError):
            log.append((t, -1, ""))
        finally:
            sem.release()

    tasks: set[asyncio.Task[None]] = set()
    next_t = time.monotonic()
    while next_t < until:
        await asyncio.sleep(max(0.0, next_t - time.monotonic()))
        if sem.locked():
            log.append((next_t, 0, ""))  # skipped: the bound was reached
        else:
            await sem.acquire()
            task = asyncio.create_task(one(next_t, len(log) + len(tasks)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        next_t += 1.0 / rate_rps
    await asyncio.gather(*tasks)


async def _run(args: argparse.Namespace, procs: ProcessSet, run_dir: Path, prefix: str) -> dict:
    _, engines = await start_fleet(procs, DEMO_FLEET, run_dir)
    stack = FastrouteStack(
        procs, DEMO_FLEET, engines, SOURCES, run_dir, prefix,
        period_s=args.period_s, slo_s=SLO_S, edit_config=_edit,
    )  # fmt: skip
    urls = await stack.start()
    offered_rpm = 2 * LIMIT_RPM
    split = {SOURCES[0]: 0.8, SOURCES[1]: 0.2}
    t0 = time.monotonic()
    until = t0 + args.warmup_s + args.measure_s
    logs: dict[tuple[str, str], list] = {}
    timeout = aiohttp.ClientTimeout(total=30.0)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        jobs = []
        for src, frac in split.items():
            logs[(src, "a")] = []
            jobs.append(
                _stream(
                    s, urls[src], "sk-tenant-a", offered_rpm * frac / 60, until, logs[(src, "a")]
                )
            )
        logs[(SOURCES[1], "b")] = []
        jobs.append(
            _stream(s, urls[SOURCES[1]], "sk-tenant-b", 2.0, until, logs[(SOURCES[1], "b")])
        )
        load = asyncio.gather(*jobs)
        # The plan while the load runs (after the warm-up): per-tenant admitted/shed.
        await asyncio.sleep(args.warmup_s)
        async with s.get(stack.controller_url + "/v1/plan") as r:
            plan = await r.json()
        await load
    start = t0 + args.warmup_s
    minutes = int(args.measure_s // 60)
    per_minute = [0] * max(1, minutes)
    per_proxy: Counter[str] = Counter()
    statuses: Counter[str] = Counter()
    for (src, tenant), log in logs.items():
        for t, status, code in log:
            if t < start:
                continue
            statuses[f"{tenant}:{status}{':' + code if code else ''}"] += 1
            if tenant == "a" and status == 200:
                m = int((t - start) // 60)
                if m < len(per_minute):
                    per_minute[m] += 1
                    per_proxy[src] += 1
    window_min = len(per_minute) if minutes else args.measure_s / 60
    mean = sum(per_minute) / window_min
    demand = {src: offered_rpm * f for src, f in split.items()}
    return {
        "limit_rpm": LIMIT_RPM,
        "offered_rpm": demand,
        "admitted_per_minute": per_minute,
        "admitted_mean_rpm": mean,
        "error_pct": 100.0 * (mean - LIMIT_RPM) / LIMIT_RPM,
        "admitted_by_proxy_rpm": {k: v / window_min for k, v in per_proxy.items()},
        "statuses": dict(statuses),
        "without_controller_rpm": {
            "proxy_count=2": sum(min(d, LIMIT_RPM / 2) for d in demand.values()),
            "limit per replica": sum(min(d, LIMIT_RPM) for d in demand.values()),
        },
        "plan_tenants": plan.get("tenants"),
        "plan_classes": [
            {k: c.get(k) for k in ("name", "demand_rps", "shed_fraction")}
            for c in plan.get("classes", [])
        ],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warmup-s", type=float, default=45.0)
    p.add_argument("--measure-s", type=float, default=300.0)
    p.add_argument("--period-s", type=float, default=5.0)
    p.add_argument("--keep", action="store_true", help="keep the run directory (logs)")
    args = p.parse_args()
    prefix = run_prefix("tenants")
    run_dir = Path(tempfile.mkdtemp(prefix=prefix + "-"))
    procs = ProcessSet(run_dir)
    try:
        result = asyncio.run(_run(args, procs, run_dir, prefix))
    finally:
        procs.stop_all()
        with contextlib.suppress(OSError):
            remove_segments(prefix)
    print(json.dumps(result, indent=2))
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    else:
        print(f"logs in {run_dir}")
    ok = abs(result["error_pct"]) <= 3.0
    print(
        f"admitted {result['admitted_mean_rpm']:.1f}/min vs {LIMIT_RPM}: {'PASS' if ok else 'MISS'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
