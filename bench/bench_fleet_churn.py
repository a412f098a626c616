"""Fleet churn under load (a script, not a pytest file): engines join and leave a running
``fastroute serve`` through the admin API and DNS discovery while streams flow.

Set-up, all on 127.0.0.1: emulated engines (:class:`fastroute.emulator.server.EmulatedFleet`,
in this process), a real DNS server (:class:`fastroute.testing.dns.DnsTestServer`, SRV
records), and ``fastroute serve --workers 2`` (its own process tree) with two config
engines and one ``[[discovery]]`` section (``--interval-s``). The load is this process:
``--concurrency`` closed-loop clients sending streamed chats, each on a fresh connection
(so ``SO_REUSEPORT`` spreads them over both workers), for ``--duration-s`` seconds.

Churn, every ``--step-s`` seconds: add an engine (API), add a DNS record, delete the
API engine, replace the DNS record by another, drain a config engine (API). For each
join, the time from the change (the API's reply; the DNS record edit) to the first
response served by the new engine; for each leave, that no response of it starts after
the change has been applied. A request is *lost* when it fails or its stream ends
without ``[DONE]``.

Acceptance: every added engine gets traffic within one scrape period
(``proxy.scrape_interval_s``, 1 s; for DNS joins one ``--interval-s`` more, the
re-resolution wait) and 0 requests are lost.

Run: ``.venv/bin/python bench/bench_fleet_churn.py`` (about 20 s); ``--json PATH`` also
writes the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from fastroute.emulator.model import OutputLengthDistribution
from fastroute.emulator.server import EmulatedFleet, fleet_specs
from fastroute.testing.configs import engines_toml
from fastroute.testing.dns import DnsTestServer

MODEL = "demo-8b"
#: The proxy's default ``scrape_interval_s``: the acceptance bound of a join.
SCRAPE_PERIOD_S = 1.0
#: Short outputs (≈4 tokens) keep streams brief, so many requests cross each change.
OUTPUTS = OutputLengthDistribution(mu=1.4, sigma=0.2)
START_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 30.0
SRV_NAME = "_http._tcp.pool.test"


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    failed: int = 0
    first_seen: dict[str, float] = field(default_factory=dict)
    last_started: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _one(s: aiohttp.ClientSession, url: str, i: int, tally: Tally) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"churn {i}"}],
        "max_tokens": 8,
        "stream": True,
    }
    tally.sent += 1
    try:
        async with s.post(url + "/v1/chat/completions", json=body) as r:
            engine = r.headers.get("x-fastroute-engine", "?")
            now = time.monotonic()
            tally.first_seen.setdefault(engine, now)
            tally.last_started[engine] = now
            text = await r.text()
            if r.status != 200 or "data: [DONE]" not in text:
                raise RuntimeError(f"status {r.status}: {text[:200]}")
        tally.ok += 1
    except (TimeoutError, aiohttp.ClientError, RuntimeError) as exc:
        tally.failed += 1
        tally.errors.append(f"{type(exc).__name__}: {exc}")


async def _load(url: str, concurrency: int, until: float, tally: Tally) -> None:
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    counter = iter(range(10**9))

    async def client() -> None:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True), timeout=timeout
        ) as s:
            while time.monotonic() < until:
                await _one(s, url, next(counter), tally)

    await asyncio.gather(*(client() for _ in range(concurrency)))


async def _wait_ready(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            assert proc.poll() is None, "fastroute serve exited"
            with contextlib.suppress(aiohttp.ClientError):
                async with s.get(url + "/ready") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.05)
    raise TimeoutError("fastroute serve did not get ready")


async def _churn(args: argparse.Namespace) -> dict[str, object]:
    specs = fleet_specs(6, model_name=MODEL, profile="h100", output_lengths=OUTPUTS)
    async with EmulatedFleet(specs) as fleet:
        ports = [int(u.rsplit(":", 1)[1]) for u in fleet.urls]
        with DnsTestServer() as dns, tempfile.TemporaryDirectory() as tmp:
            dns.set_a("e.test", ["127.0.0.1"])
            dns.set_srv(SRV_NAME, [])
            config = Path(tmp) / "fastroute.toml"
            port = _free_port()
            config.write_text(
                engines_toml(fleet.urls[:2], MODEL)
                + '[policy]\ndefault = "least-request"\n'
                + f'[[discovery]]\nname = "pool"\ndns_name = "{SRV_NAME}"\nrecord = "SRV"\n'
                + f'nameserver = "{dns.nameserver}"\ninterval_s = {args.interval_s}\n'
                + f'timeout_s = {args.interval_s / 2}\nmodels = ["{MODEL}"]\nhardware = "h100"\n'
                + f'[proxy]\nport = {port}\nworkers = 2\nstats_name = "churn-{os.getpid()}"\n'
                + f'table_name = "churn-absent-{os.getpid()}"\n'
            )
            shm = Path(tmp) / "shm"
            shm.mkdir()
            env = {**os.environ, "FASTROUTE_SHM_DIR": str(shm), "PYTHONUNBUFFERED": "1"}
            log = (Path(tmp) / "serve.log").open("wb")
            proc = subprocess.Popen(
                [sys.executable, "-m", "fastroute", "serve", "--config", str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
            url = f"http://127.0.0.1:{port}"
            try:
                await _wait_ready(url, proc)
                return await _run_schedule(args, url, dns, fleet.urls, ports)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=20)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                log.close()


async def _run_schedule(
    args: argparse.Namespace, url: str, dns: DnsTestServer, urls: list[str], ports: list[int]
) -> dict[str, object]:
    tally = Tally()
    start = time.monotonic()
    load = asyncio.create_task(_load(url, args.concurrency, start + args.duration_s, tally))
    joins: list[tuple[str, str, float]] = []  # (how, engine, change time)
    leaves: list[tuple[str, str, float]] = []
    api = url + "/admin/engines"
    dns_a, dns_b = f"pool/127.0.0.1:{ports[3]}", f"pool/127.0.0.1:{ports[4]}"
    async with aiohttp.ClientSession() as s:

        async def step(n: int) -> None:
            await asyncio.sleep(max(0.0, start + n * args.step_s - time.monotonic()))

        await step(1)
        engine = {"name": "api-2", "url": urls[2], "models": [MODEL], "hardware": "h100"}
        async with s.post(api, json=engine) as r:
            assert r.status == 201, await r.text()
        joins.append(("api", "api-2", time.monotonic()))
        await step(2)
        dns.set_srv(SRV_NAME, [("e.test", ports[3])])
        joins.append(("dns", dns_a, time.monotonic()))
        await step(3)
        async with s.delete(api + "/api-2") as r:
            assert r.status == 200, await r.text()
        leaves.append(("api delete", "api-2", time.monotonic()))
        await step(4)
        dns.set_srv(SRV_NAME, [("e.test", ports[4])])
        joins.append(("dns", dns_b, time.monotonic()))
        leaves.append(("dns removal", dns_a, time.monotonic()))
        await step(5)
        async with s.post(api + "/engine-0/drain") as r:
            assert r.status == 200, await r.text()
        leaves.append(("api drain", "engine-0", time.monotonic()))
    await load
    return _summary(args, tally, joins, leaves, start)


def _summary(
    args: argparse.Namespace,
    tally: Tally,
    joins: list[tuple[str, str, float]],
    leaves: list[tuple[str, str, float]],
    start: float,
) -> dict[str, object]:
    join_rows = []
    for how, engine, at in joins:
        first = tally.first_seen.get(engine)
        delay = None if first is None else first - at
        bound = SCRAPE_PERIOD_S + (args.interval_s if how == "dns" else 0.0)
        join_rows.append({"how": how, "engine": engine, "first_request_s": delay, "bound_s": bound})
    leave_rows = []
    for how, engine, at in leaves:
        last = tally.last_started.get(engine)
        leave_rows.append(
            {
                "how": how,
                "engine": engine,
                "last_start_after_change_s": None if last is None else last - at,
            }
        )
    return {
        "duration_s": round(time.monotonic() - start, 2),
        "concurrency": args.concurrency,
        "interval_s": args.interval_s,
        "sent": tally.sent,
        "ok": tally.ok,
        "failed": tally.failed,
        "errors": tally.errors[:5],
        "joins": join_rows,
        "leaves": leave_rows,
    }


def _print(result: dict[str, object]) -> None:
    print(
        f"requests sent {result['sent']}, ok {result['ok']}, failed {result['failed']} "
        f"({result['duration_s']} s, concurrency {result['concurrency']}, "
        f"DNS interval {result['interval_s']} s)"
    )
    for row in result["joins"]:  # type: ignore[attr-defined]
        d = row["first_request_s"]
        verdict = "MISSED" if d is None or d > row["bound_s"] else "ok"
        shown = "never" if d is None else f"{d:.3f} s"
        print(
            f"  join  {row['how']:<4} {row['engine']:<26} first request after {shown} "
            f"(bound {row['bound_s']:.1f} s) {verdict}"
        )
    for row in result["leaves"]:  # type: ignore[attr-defined]
        d = row["last_start_after_change_s"]
        shown = "none" if d is None else f"{d:+.3f} s"
        print(
            f"  leave {row['how']:<12} {row['engine']:<26} "
            f"last request started {shown} after the change"
        )
    for err in result["errors"]:  # type: ignore[attr-defined]
        print("  error:", err)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=18.0)
    parser.add_argument("--step-s", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--interval-s", type=float, default=0.5, help="discovery interval_s")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.duration_s < 6 * args.step_s:
        parser.error("--duration-s must cover the 5 churn steps (>= 6 * --step-s)")
    result = asyncio.run(_churn(args))
    _print(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    lost = result["failed"]
    late = [
        r
        for r in result["joins"]
        if r["first_request_s"] is None or r["first_request_s"] > r["bound_s"]
    ]  # type: ignore[attr-defined]
    return 0 if lost == 0 and not late else 1


if __name__ == "__main__":
    sys.exit(main())
