"""Proxy overhead figure (a script, not a pytest file): router CPU per request and per token.

Set-up, all on 127.0.0.1, every server its own process (its own session, so its
whole process tree is measured and stopped):

* the engine is ``bench/stub_engine.py``: instant answers, ``--tokens`` SSE events
  per stream in a few writes;
* targets: ``direct`` (the client talks to the stub), ``fastroute`` (``fastroute
  serve`` with a generated config: one engine, the stub, one worker), ``nginx`` (a
  generated minimal reverse-proxy config, one worker, upstream keep-alive, no
  buffering; skipped when ``nginx`` is not on PATH) and ``sglang-router``
  (``python -m sglang_router.launch_router --policy round_robin``; skipped when the
  module is not importable);
* the load is this process: an aiohttp client on uvloop, closed loop. Per target:
  a warm-up, then (1) ``--requests`` small non-streaming chat requests at concurrency
  ``--concurrency``, (2) ``--streams`` streaming requests of ``--tokens`` tokens at the
  same concurrency, (3) ``--latency-requests`` non-streaming requests at concurrency
  1. Each phase is bounded by ``--phase-timeout`` seconds (the figures then use the
  requests that completed).

Measured: CPU seconds (utime + stime, plus cutime + cstime of reaped children) of
every process in the target's session, from ``/proc/<pid>/stat``, before and after a
phase. Per request = delta / requests of phase 1; per streamed token = delta / tokens
received in phase 2 (the per-request cost of those streams included, amortised over
``--tokens`` tokens). Latency: client-side p50/p99 of phase 3; "added" is the
target's value minus the direct one of the same run. The stub's own CPU is shown for
reference. The machine has 2 cores shared by client, stub and router, so the figures
of one run are comparable with each other, not across machines.

Side by side with another version of fastroute: ``--ref-tree DIR`` names a source tree
(e.g. ``git archive HEAD fastroute | tar -x -C DIR`` plus the built ``_core`` extension
modules copied in); the target ``fastroute-ref`` runs ``fastroute serve`` from it
(``PYTHONPATH=DIR``, working directory ``DIR``). ``--rounds N`` runs the targets N
times, the order reversed every other round (alternated pairs), and prints the
per-target medians after the last round's table.

The target ``fastroute-traced`` is ``fastroute`` with ``[tracing]`` on (every request
sampled, or ``--trace-sample-ratio``; spans exported over OTLP/HTTP to the stub's
``/v1/traces`` sink): the cost of tracing, as a ratio to ``fastroute`` in the same run.

Run: ``.venv/bin/python bench/bench_proxy.py`` (full, about 2 min) or ``--quick``
(smoke, < 20 s). ``--json PATH`` also writes the numbers; ``--targets`` picks some;
``--policy NAME`` sets the fastroute targets' default policy (compare ``prefix-hrw``
with ``weighted-hrw``: one run each, same session); ``--profile-dir DIR`` records
fastroute with py-spy (raw collapsed stacks) during
phases 1 and 2 (its CPU figures are then not representative); ``--profile-native`` adds
C frames (uvloop, libpython, syscalls), pausing the process per sample, which over-weights
syscalls: compare with ``perf`` before trusting a syscall's share.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import platform
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import uvloop

from fastroute.fleetbench.process import ProcessDiedError, free_port, stop_group, wait_http_ok
from fastroute.fleetbench.procstat import session_cpu_s

ROOT = Path(__file__).resolve().parents[1]
MODEL = "stub-model"
TARGETS = ("direct", "fastroute", "fastroute-traced", "fastroute-ref", "nginx", "sglang-router")
#: ``--ref-tree``: the source tree ``fastroute-ref`` runs (None: that target is skipped).
REF_TREE: Path | None = None
#: ``--trace-sample-ratio``: ``tracing.sample_ratio`` of the ``fastroute-traced`` target.
TRACE_SAMPLE_RATIO = 1.0
#: ``--policy``: the default policy of the fastroute targets (None: the configuration's).
POLICY: str | None = None
READY_TIMEOUT_S = 30.0
#: Every process this script started, so that an interrupt stops them all.
_STARTED: list[Server] = []


class Server:
    """A server process in its own session; stopped with its whole process group."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: Path = ROOT,
    ) -> None:
        self.name = name
        self.cmd = cmd
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=self.log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
        _STARTED.append(self)
        self.lines: queue.Queue[str] = queue.Queue()
        assert self.proc.stdout is not None
        out = self.proc.stdout
        threading.Thread(
            target=lambda: [self.lines.put(x.decode(errors="replace")) for x in out],
            daemon=True,
        ).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu_s(self) -> float:
        """CPU seconds of the server's process tree (its session) so far."""
        return session_cpu_s(self.proc.pid)

    def stderr_tail(self, n: int = 2000) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-n:]

    def check_alive(self) -> None:
        """Raise ProcessDiedError (a RuntimeError, with stderr's end) if the server exited."""
        if self.proc.poll() is not None:
            raise ProcessDiedError(
                f"{self.name} exited with {self.proc.returncode}: {self.stderr_tail()}"
            )

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after 5 s."""
        stop_group(self.proc, timeout_s=5.0)
        if self.proc.stdout:
            self.proc.stdout.close()
        self.log.close()
        if self in _STARTED:
            _STARTED.remove(self)


def stop_all() -> None:
    for server in list(reversed(_STARTED)):
        server.stop()


# -- targets ---------------------------------------------------------------------------------------
def start_stub(
    tokens: int, stream_writes: int, write_interval_ms: float = 0.0
) -> tuple[Server, str]:
    cmd = [sys.executable, str(ROOT / "bench" / "stub_engine.py"), "--port", "0",
           "--tokens", str(tokens), "--stream-writes", str(stream_writes),
           "--write-interval-ms", str(write_interval_ms)]  # fmt: skip
    stub = Server("stub", cmd)
    try:
        line = stub.lines.get(timeout=READY_TIMEOUT_S)
    except queue.Empty:
        raise RuntimeError(f"stub did not start: {stub.stderr_tail()}") from None
    return stub, line.strip().rsplit(" ", 1)[1]


def traced_cmd(tmp: Path, stub_url: str, port: int) -> list[str]:
    """``fastroute`` with ``[tracing]`` on (``--trace-sample-ratio``, default every request
    sampled), spans exported over OTLP/HTTP to the stub's ``/v1/traces`` sink (the export's
    CPU is the router's)."""
    return fastroute_cmd(
        tmp,
        stub_url,
        port,
        f"\n[tracing]\nenabled = true\nsample_ratio = {TRACE_SAMPLE_RATIO}\n"
        f'otlp_endpoint = "{stub_url}/v1/traces"\n',
    )


def fastroute_cmd(tmp: Path, stub_url: str, port: int, extra: str = "") -> list[str]:
    config = tmp / "fastroute.toml"
    config.write_text(
        f"""# generated by bench/bench_proxy.py
[[engines]]
name = "stub"
url = "{stub_url}"
models = ["{MODEL}"]
hardware = "h100"
capacity_rps = 1000.0

[proxy]
host = "127.0.0.1"
port = {port}
workers = 1
drain_timeout_s = 2.0
table_name = "fastroute-bench-absent-{uuid.uuid4().hex[:12]}"
"""
        + (f'\n[policy]\ndefault = "{POLICY}"\n' if POLICY else "")
        + extra
    )
    return [sys.executable, "-m", "fastroute", "--log-level", "WARNING", "serve",
            "--config", str(config)]  # fmt: skip


def nginx_cmd(tmp: Path, stub_url: str, port: int) -> list[str]:
    upstream = stub_url.split("://", 1)[1]
    conf = tmp / "nginx.conf"
    conf.write_text(
        f"""# generated by bench/bench_proxy.py
daemon off;
master_process on;
worker_processes 1;
user root;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    keepalive_requests 1000000;
    upstream engine {{ server {upstream}; keepalive 128; keepalive_requests 1000000; }}
    server {{
        listen 127.0.0.1:{port} backlog=1024;
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
        }}
    }}
}}
"""
    )
    return ["nginx", "-p", str(tmp), "-c", str(conf)]


def sglang_cmd(tmp: Path, stub_url: str, port: int) -> list[str]:
    return [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", stub_url,
            "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-port", str(free_port()), "--log-level", "warn"]  # fmt: skip


def available(target: str) -> str | None:
    """None if ``target`` can run here, else why not."""
    if target == "nginx" and shutil.which("nginx") is None:
        return "nginx is not on PATH"
    if target == "sglang-router" and importlib.util.find_spec("sglang_router") is None:
        return "sglang_router is not importable (pip install sglang-router)"
    if target == "fastroute-ref" and (REF_TREE is None or not (REF_TREE / "fastroute").is_dir()):
        return "no --ref-tree DIR with a fastroute/ package"
    return None


async def wait_ready(server: Server, url: str) -> None:
    """Poll a real chat request through ``url`` until it answers 200 (bounded)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    try:
        await wait_http_ok(
            url + "/v1/chat/completions",
            timeout_s=READY_TIMEOUT_S,
            process=server,
            json_body=body,
        )
    except TimeoutError as exc:
        raise RuntimeError(str(exc)) from None


# -- load ------------------------------------------------------------------------------------------
@dataclass
class PhaseResult:
    requests: int = 0
    errors: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)


async def run_phase(
    session: aiohttp.ClientSession,
    url: str,
    *,
    n: int,
    concurrency: int,
    stream: bool,
    tokens: int,
    timeout_s: float,
    system_chars: int = 0,
) -> PhaseResult:
    """``n`` requests by ``concurrency`` closed-loop workers; stop early at ``timeout_s``."""
    messages = [{"role": "user", "content": "Say ok."}]
    if system_chars:
        messages.insert(0, {"role": "system", "content": "s" * system_chars})
    body = {"model": MODEL, "messages": messages,
            "max_tokens": tokens if stream else 1, "stream": stream}  # fmt: skip
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    target = url + "/v1/chat/completions"
    result = PhaseResult()
    remaining = n
    t0 = time.perf_counter()
    deadline = t0 + timeout_s

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0 and time.perf_counter() < deadline:
            remaining -= 1
            start = time.perf_counter()
            try:
                async with session.post(target, data=data, headers=headers) as resp:
                    payload = await resp.read()
                    ok = resp.status == 200
            except (TimeoutError, aiohttp.ClientError):
                ok, payload = False, b""
            if not ok:
                result.errors += 1
                continue
            result.latencies_s.append(time.perf_counter() - start)
            result.requests += 1
            if stream:
                result.tokens += payload.count(b"data: {")

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.wall_s = time.perf_counter() - t0
    return result


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@contextlib.contextmanager
def py_spy(pid: int, out: Path | None, duration_s: int, native: bool = False) -> Iterator[None]:
    """Record ``pid`` with py-spy into ``out`` (raw collapsed stacks) while the block runs.

    ``native``: C frames too (uvloop, httptools, the kernel entry points); py-spy then
    pauses the process for each sample, which costs the router some CPU.
    """
    if out is None:
        yield
        return
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    # --subprocesses: ``fastroute serve`` may run its worker as a child of a supervisor.
    cmd = [exe, "record", "--pid", str(pid), "--format", "raw", "--rate", "250",
           "--subprocesses", "--duration", str(duration_s), "--output", str(out)]  # fmt: skip
    cmd.append("--native" if native else "--nonblocking")
    spy = Server("py-spy", cmd)
    time.sleep(0.5)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(spy.pid, signal.SIGINT)  # py-spy writes its output on SIGINT
        with contextlib.suppress(subprocess.TimeoutExpired):
            spy.proc.wait(timeout=20)
        spy.stop()


async def measure(
    target: str, url: str, server: Server | None, stub: Server, args: argparse.Namespace
) -> dict[str, object]:
    """Run the three phases against ``url``; CPU of ``server`` (None: direct) and the stub."""
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=30)
    profile = None
    if args.profile_dir is not None and target == "fastroute" and server is not None:
        profile = Path(args.profile_dir)
        profile.mkdir(parents=True, exist_ok=True)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        common = {"concurrency": args.concurrency, "tokens": args.tokens,
                  "timeout_s": args.phase_timeout, "system_chars": args.system_chars}  # fmt: skip
        await run_phase(session, url, n=args.warmup, stream=False, **common)
        await run_phase(session, url, n=args.warmup // 10 + 1, stream=True, **common)
        out: dict[str, object] = {"target": target}
        for phase, n, stream in (("request", args.requests, False),
                                 ("stream", args.streams, True)):  # fmt: skip
            spy_out = profile / f"fastroute-{phase}.txt" if profile else None
            spy_s = int(args.phase_timeout) + 5
            with py_spy(server.pid if server else 0, spy_out, spy_s, args.profile_native):
                cpu0 = server.cpu_s() if server else 0.0
                stub0 = stub.cpu_s()
                res = await run_phase(session, url, n=n, stream=stream, **common)
                cpu = (server.cpu_s() if server else 0.0) - cpu0
                stub_cpu = stub.cpu_s() - stub0
            per = res.tokens if stream else res.requests
            unit = "token" if stream else "request"
            out[f"{phase}_count"] = res.requests
            out[f"{phase}_errors"] = res.errors
            out[f"{phase}_per_s"] = round(res.requests / res.wall_s, 1)
            out[f"{phase}_router_cores"] = round(cpu / res.wall_s, 3) if server else None
            out[f"router_cpu_us_per_{unit}"] = round(cpu / per * 1e6, 2) if server and per else None
            out[f"stub_cpu_us_per_{unit}"] = round(stub_cpu / per * 1e6, 2) if per else None
            if stream:
                out["stream_tokens"] = res.tokens
                out["stream_tokens_per_s"] = round(res.tokens / res.wall_s, 1)
                out["tokens_per_stream"] = round(res.tokens / max(1, res.requests), 1)
        lat = await run_phase(
            session, url, n=args.latency_requests, stream=False, concurrency=1,
            tokens=args.tokens, timeout_s=args.phase_timeout, system_chars=args.system_chars,
        )  # fmt: skip
        out["latency_count"] = lat.requests
        out["latency_errors"] = lat.errors
        out["p50_ms"] = round(_pct(lat.latencies_s, 0.50) * 1e3, 3)
        out["p99_ms"] = round(_pct(lat.latencies_s, 0.99) * 1e3, 3)
    return out


async def bench_target(
    target: str, stub_url: str, stub: Server, tmp: Path, args: argparse.Namespace
) -> dict[str, object]:
    if target == "direct":
        return await measure(target, stub_url, None, stub, args)
    port = free_port()
    build = {"fastroute": fastroute_cmd, "fastroute-traced": traced_cmd,
             "fastroute-ref": fastroute_cmd, "nginx": nginx_cmd,
             "sglang-router": sglang_cmd}[target]  # fmt: skip
    workdir = Path(tempfile.mkdtemp(prefix=f"{target}-", dir=tmp))
    if target == "fastroute-ref":
        assert REF_TREE is not None
        env = {**os.environ, "PYTHONPATH": str(REF_TREE)}
        server = Server(target, build(workdir, stub_url, port), env=env, cwd=REF_TREE)
    else:
        server = Server(target, build(workdir, stub_url, port))
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_ready(server, url)
        return await measure(target, url, server, stub, args)
    finally:
        server.stop()


# -- report ----------------------------------------------------------------------------------------
def _fmt(value: object, digits: int = 1) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(results: list[dict[str, object]]) -> str:
    direct = next((r for r in results if r["target"] == "direct"), None)
    rows = [
        "| target | req/s (c={c}) | router CPU µs/request | stub CPU µs/request "
        "| tokens/s streamed | router CPU µs/streamed token | p50 / p99 ms (c=1) "
        "| added p50 / p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "skipped" in r:
            rows.append(f"| {r['target']} | skipped: {r['skipped']} | | | | | | |")
            continue
        added = "—"
        if direct is not None and r is not direct:
            added = (
                f"{float(r['p50_ms']) - float(direct['p50_ms']):+.3f} / "  # type: ignore[arg-type]
                f"{float(r['p99_ms']) - float(direct['p99_ms']):+.3f}"  # type: ignore[arg-type]
            )
        rows.append(
            f"| {r['target']} | {_fmt(r['request_per_s'], 0)} "
            f"| {_fmt(r['router_cpu_us_per_request'])} | {_fmt(r['stub_cpu_us_per_request'])} "
            f"| {_fmt(r['stream_tokens_per_s'], 0)} | {_fmt(r['router_cpu_us_per_token'], 2)} "
            f"| {_fmt(r['p50_ms'], 3)} / {_fmt(r['p99_ms'], 3)} | {added} |"
        )
    return "\n".join(rows)


def goals(results: list[dict[str, object]]) -> list[str]:
    """Issue 4's goals, checked against this run (when the targets ran)."""
    by = {str(r["target"]): r for r in results if "skipped" not in r}
    fr, sg, direct = by.get("fastroute"), by.get("sglang-router"), by.get("direct")
    lines: list[str] = []
    if fr is not None and by.get("fastroute-ref") is not None:
        ref = by["fastroute-ref"]
        for key in ("router_cpu_us_per_request", "router_cpu_us_per_token"):
            ratio = float(fr[key]) / float(ref[key])  # type: ignore[arg-type]
            lines.append(f"- {key}: fastroute / fastroute-ref = {ratio:.2f}")
    traced = by.get("fastroute-traced")
    if fr is not None and traced is not None:
        for key in ("router_cpu_us_per_request", "router_cpu_us_per_token"):
            ratio = float(traced[key]) / float(fr[key])  # type: ignore[arg-type]
            lines.append(f"- {key}: fastroute-traced / fastroute = {ratio:.2f}")
    if fr and sg:
        for key, limit in (("router_cpu_us_per_request", 1.5), ("router_cpu_us_per_token", 1.0)):
            ratio = float(fr[key]) / float(sg[key])  # type: ignore[arg-type]
            verdict = "met" if ratio <= limit else "MISSED"
            lines.append(f"- {key}: fastroute / sglang-router = {ratio:.2f} (goal ≤ {limit}): "
                         f"{verdict}")  # fmt: skip
    if fr and direct:
        added = float(fr["p50_ms"]) - float(direct["p50_ms"])  # type: ignore[arg-type]
        verdict = "met" if added <= 0.5 else "MISSED"
        lines.append(f"- added p50 latency at c=1: {added:.3f} ms (goal ≤ 0.5 ms): {verdict}")
    return lines


MEDIAN_KEYS = ("request_per_s", "router_cpu_us_per_request", "router_cpu_us_per_token", "p50_ms",
               "p99_ms")  # fmt: skip


def medians(rounds: list[list[dict[str, object]]]) -> list[dict[str, object]]:
    """Per target, the median of each figure over the rounds it ran in."""
    out: list[dict[str, object]] = []
    for target in dict.fromkeys(str(r["target"]) for rs in rounds for r in rs):
        runs = [r for rs in rounds for r in rs if r["target"] == target and "skipped" not in r]
        if not runs:
            continue
        row: dict[str, object] = {"target": target, "rounds": len(runs)}
        for key in MEDIAN_KEYS + ("stub_cpu_us_per_request", "stream_tokens_per_s"):
            values = sorted(float(r[key]) for r in runs if r.get(key) is not None)  # type: ignore[arg-type]
            if values:
                mid = len(values) // 2
                row[key] = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
        out.append(row)
    return out


async def main_async(args: argparse.Namespace) -> list[list[dict[str, object]]]:
    rounds: list[list[dict[str, object]]] = []
    for i in range(args.rounds):
        order = list(args.targets) if i % 2 == 0 else [args.targets[0], *args.targets[:0:-1]]
        if args.rounds > 1:
            print(f"round {i + 1}/{args.rounds}: {' '.join(order)}", file=sys.stderr, flush=True)
        rounds.append(await run_round(args, order))
    return rounds


async def run_round(args: argparse.Namespace, targets: list[str]) -> list[dict[str, object]]:
    results: list[dict[str, object]] = []
    stub, stub_url = start_stub(args.tokens, args.stream_writes, args.write_interval_ms)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-proxy-") as tmp:
            for target in targets:
                why = available(target)
                if why is not None:
                    print(f"[{target}] skipped: {why}", file=sys.stderr)
                    results.append({"target": target, "skipped": why})
                    continue
                print(f"[{target}] running …", file=sys.stderr, flush=True)
                t0 = time.monotonic()
                try:
                    result = await bench_target(target, stub_url, stub, Path(tmp), args)
                except RuntimeError as exc:
                    print(f"[{target}] failed: {exc}", file=sys.stderr)
                    results.append({"target": target, "skipped": f"failed to run: {exc}"[:200]})
                    continue
                result["elapsed_s"] = round(time.monotonic() - t0, 1)
                print(f"[{target}] {json.dumps(result)}", file=sys.stderr, flush=True)
                results.append(result)
    finally:
        stub.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="smoke run, < 20 s")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS))
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=None, help="phase 1 (default 20000)")
    parser.add_argument("--streams", type=int, default=None, help="phase 2 (default 2000)")
    parser.add_argument("--tokens", type=int, default=100, help="tokens per stream")
    parser.add_argument("--stream-writes", type=int, default=4, help="stub writes per stream")
    parser.add_argument(
        "--write-interval-ms",
        type=float,
        default=0.0,
        help="ms between the stub's writes of a stream (default 0: at once; >0 paces them "
        "like decode steps, one router wake-up per write)",
    )
    parser.add_argument(
        "--system-chars",
        type=int,
        default=0,
        help="prepend a system message of this many characters (default 0: a 7-character "
        "prompt; real chat bodies are kilobytes)",
    )
    parser.add_argument("--latency-requests", type=int, default=None, help="phase 3 (500)")
    parser.add_argument("--warmup", type=int, default=None, help="default 1000")
    parser.add_argument("--phase-timeout", type=float, default=None, help="seconds (default 25)")
    parser.add_argument("--profile-dir", metavar="DIR", help="py-spy fastroute into DIR")
    parser.add_argument(
        "--profile-native",
        action="store_true",
        help="with --profile-dir: native frames too (py-spy --native)",
    )
    parser.add_argument("--ref-tree", metavar="DIR", help="source tree of target fastroute-ref")
    parser.add_argument("--rounds", type=int, default=1, help="repeat, alternating the order")
    parser.add_argument(
        "--trace-sample-ratio", type=float, default=1.0,
        help="tracing.sample_ratio of the fastroute-traced target (default 1.0)",
    )  # fmt: skip
    parser.add_argument(
        "--policy",
        help="default policy of the fastroute targets (e.g. weighted-hrw; default: the "
        "configuration's, prefix-hrw)",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    global REF_TREE, POLICY, TRACE_SAMPLE_RATIO
    if not 0.0 <= args.trace_sample_ratio <= 1.0:
        parser.error("--trace-sample-ratio must be in [0, 1]")
    TRACE_SAMPLE_RATIO = args.trace_sample_ratio
    REF_TREE = Path(args.ref_tree).resolve() if args.ref_tree else None
    POLICY = args.policy
    quick = args.quick
    defaults = {"requests": (20000, 1000), "streams": (2000, 100), "latency_requests": (500, 100),
                "warmup": (1000, 100), "phase_timeout": (25.0, 3.0)}  # fmt: skip
    for name, (full, small) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    if "direct" not in args.targets:
        args.targets.insert(0, "direct")

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)  # also when started with SIGINT ignored (`&`)
    started = time.monotonic()
    try:
        rounds = uvloop.run(main_async(args))
    except KeyboardInterrupt:
        print("interrupted; stopping every server", file=sys.stderr)
        return 130
    finally:
        stop_all()
    print(
        f"\nProxy overhead, {platform.node()} ({os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}): stub engine, one router worker, c={args.concurrency}, "
        f"{args.tokens} tokens/stream in {args.stream_writes} writes"
        f"{f' {args.write_interval_ms:g} ms apart' if args.write_interval_ms else ''}; "
        f"{time.monotonic() - started:.0f} s\n"
    )
    results = rounds[-1]
    print(table(results).replace("{c}", str(args.concurrency)))
    for line in goals(results):
        print(line)
    mids = medians(rounds)
    if len(rounds) > 1:
        print(f"\nMedians over {len(rounds)} rounds (order reversed every other round):\n")
        print("| target | rounds | req/s | router CPU µs/request | router CPU µs/streamed token "
              "| p50 / p99 ms (c=1) |\n|---|---|---|---|---|---|")  # fmt: skip
        for m in mids:
            print(f"| {m['target']} | {m['rounds']} | {_fmt(m.get('request_per_s'), 0)} "
                  f"| {_fmt(m.get('router_cpu_us_per_request'))} "
                  f"| {_fmt(m.get('router_cpu_us_per_token'), 2)} "
                  f"| {_fmt(m.get('p50_ms'), 3)} / {_fmt(m.get('p99_ms'), 3)} |")  # fmt: skip
        for line in goals(mids):
            print(line)
    if args.json:
        meta = {k: v for k, v in vars(args).items() if k != "json"}
        doc = {"args": meta, "cpus": os.cpu_count(), "python": platform.python_version(),
               "results": results, "rounds": rounds, "medians": mids}  # fmt: skip
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
