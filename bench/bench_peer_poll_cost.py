"""What the proxies' peer polls cost in CPU, by poll period (a script, not a pytest file).

Set-up, all on 127.0.0.1: four emulated engines in this process and two ``fastroute
serve`` trees of one worker each that list each other in ``proxy.peers``, idle, one tree
pair per period in ``--intervals`` (``0``: no peers, the baseline). Measured over
``--seconds`` after a settling pause: the CPU seconds (user + system, every process of both
trees, from ``/proc/<pid>/stat``) as CPU milliseconds per second per host, and the polls
each host's poller completed (``fastroute_proxy_peer_polls_total{outcome="ok"}``); the CPU
less the baseline's, over the polls, is the cost of one poll on both ends (each host polls
its peer and answers its peer's polls). Idle is the worst case for the
ratio and the best for the absolute figure: under load an answer also lists the engines
with a queue and the peer's key-log entries since the last poll.

Run: ``.venv/bin/python bench/bench_peer_poll_cost.py`` (about two minutes);
``--json PATH`` also writes the numbers.
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
import uuid
from pathlib import Path
from typing import Any

import aiohttp

from fastroute.emulator.server import EmulatedFleet, fleet_specs
from fastroute.testing.configs import engines_toml

MODEL = "demo-8b"
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(
    engine_urls: list[str], peer: str | None, interval_s: float, exchange: bool, stats: str
) -> str:
    peers = f'peers = ["{peer}"]\npeer_poll_interval_s = {interval_s}\n' if peer else ""
    peers += "" if exchange else "peer_key_exchange = false\n"
    return (
        engines_toml(engine_urls, MODEL)
        + "\n[proxy]\nport = 0\n"
        + f'table_name = "fastroute-pollcost-absent-{uuid.uuid4().hex[:12]}"\n'
        + f'stats_name = "{stats}"\n'
        + peers
    )


def _stop(proc: subprocess.Popen[bytes], stats: str) -> None:
    """Stop a serve tree (its supervisor removes its segments on SIGTERM; SIGKILL after
    10 s) and remove whatever of its segments is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    for leftover in Path("/dev/shm").glob(f"{stats}*"):
        leftover.unlink(missing_ok=True)


def _session_cpu_s(session_id: int) -> float:
    """User + system CPU seconds of every live process of one session (a serve tree)."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            text = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[3]) == session_id:  # field 6 of stat: the session id
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / _CLOCK_TICKS


async def _wait_healthy(url: str, deadline_s: float) -> None:
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline_s:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy")


async def _polls_ok(s: aiohttp.ClientSession, url: str) -> float:
    """Polls of its peer a one-worker proxy completed (its ``/metrics``)."""
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("fastroute_proxy_peer_polls_total{") and 'outcome="ok"' in line
    )


async def _measure(
    engine_urls: list[str], interval_s: float, args: argparse.Namespace, tmp: Path
) -> tuple[float, float]:
    """CPU ms per second per host, and completed polls per second per host, of two serve
    trees polling each other every ``interval_s`` (0: not at all)."""
    ports = _free_port(), _free_port()
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs = []
    stats = [f"fastroute-pollcost-stats-{uuid.uuid4().hex[:12]}" for _ in ports]
    try:
        for i, port in enumerate(ports):
            peer = urls[1 - i] if interval_s > 0 else None
            path = tmp / f"peer-{interval_s}-{i}.toml"
            path.write_text(_config(engine_urls, peer, interval_s, not args.no_exchange, stats[i]))
            cmd = [sys.executable, "-m", "fastroute", "serve", "--config", str(path)]
            cmd += ["--port", str(port), "--workers", "1"]
            procs.append(
                subprocess.Popen(
                    cmd,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        for url in urls:
            await _wait_healthy(url, time.monotonic() + 60.0)
        await asyncio.sleep(args.settle)
        async with aiohttp.ClientSession() as s:
            polls = -sum([await _polls_ok(s, url) for url in urls])
            before = sum(_session_cpu_s(p.pid) for p in procs)
            await asyncio.sleep(args.seconds)
            used = sum(_session_cpu_s(p.pid) for p in procs) - before
            polls += sum([await _polls_ok(s, url) for url in urls])
        per_host_s = args.seconds * len(procs)
        return 1000.0 * used / per_host_s, polls / per_host_s
    finally:
        for proc, name in zip(procs, stats, strict=False):
            _stop(proc, name)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    specs = fleet_specs(4, model_name=MODEL, profile="h100")
    results: dict[str, Any] = {"seconds": args.seconds, "runs": []}
    async with EmulatedFleet(specs) as fleet:
        with tempfile.TemporaryDirectory() as tmp:
            baseline = None
            for interval_s in args.intervals:
                cpu_ms, polls_per_s = await _measure(fleet.urls, interval_s, args, Path(tmp))
                if interval_s == 0:
                    baseline = cpu_ms
                row = {
                    "interval_s": interval_s,
                    "cpu_ms_per_s_per_host": round(cpu_ms, 2),
                    "polls_ok_per_s_per_host": round(polls_per_s, 1),
                }
                if baseline is not None and polls_per_s > 0:
                    extra = cpu_ms - baseline
                    row["polls_cpu_ms_per_s_per_host"] = round(extra, 2)
                    # each host sends polls_per_s and answers as many
                    row["cpu_us_per_poll_pair"] = round(1000.0 * extra / polls_per_s, 1)
                results["runs"].append(row)
                print(json.dumps(row), flush=True)
    return results


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument(
        "--intervals",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[0.0, 0.25, 0.1, 0.05],
        help="poll periods, s; 0 first: the baseline",
    )
    ap.add_argument("--seconds", type=float, default=20.0, help="measured window per period")
    ap.add_argument("--settle", type=float, default=3.0, help="pause before measuring, s")
    ap.add_argument("--no-exchange", action="store_true", help="proxy.peer_key_exchange = false")
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    return ap.parse_args()


if __name__ == "__main__":
    arguments = _parse()
    out = asyncio.run(main(arguments))
    if arguments.json:
        arguments.json.write_text(json.dumps(out, indent=2))
