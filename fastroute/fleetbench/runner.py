"""Run a benchmark spec: for each router, a fresh fleet, the router, the same workload.

Per router, in order (every process in a :class:`~fastroute.fleetbench.process.ProcessSet`,
stopped at the end whatever happens, and the run's shared memory removed):

1. start the emulated fleet (fresh, so no router inherits another's warm caches);
2. start the router (fastroute: controller + a proxy per source; others: one
   instance per source) and wait until a real request through it succeeds;
3. overhead phase: ``overhead_requests`` short sequential requests directly to the
   engines, then as many through the router (routing overhead at low load);
4. the run: the spec's seeded sessions (identical for every router), with the spec's
   faults applied on schedule (``at_s`` counts from the start of the traffic), while a
   watcher stops the run if the router dies. The first ``warmup_s`` seconds are not
   measured (multi-turn sessions need about one session lifetime to reach the target
   rate): the figures cover the requests sent after it, CPU time from ``/proc`` and
   the engine counters are taken at its end; peak RSS covers the whole run;
5. engine counters (prefix-cache hit rate, per-engine share) from the engines' ``/metrics``.

A router that is not installed is reported ``unavailable``; one that does not become
ready, ``failed to start``; one that exits during the run, ``died mid-run``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from fastroute.config import DEFAULT_POLICY_NAME
from fastroute.fleetbench.fleet import PlannedEngine, set_fault
from fastroute.fleetbench.lp_share import LpShareSampler
from fastroute.fleetbench.process import ManagedProcess, ProcessDiedError, ProcessSet, free_port
from fastroute.fleetbench.procstat import RssSampler, session_cpu_s
from fastroute.fleetbench.routers import RouterPlan, expand_command, resolve_router
from fastroute.fleetbench.scrape import EngineCounters, scrape_engines
from fastroute.fleetbench.spec import BenchSpec
from fastroute.fleetbench.stack import READY_TIMEOUT_S, FastrouteStack, remove_segments, run_prefix
from fastroute.fleetbench.stack import start_fleet as _start_fleet
from fastroute.loadgen import DriveOptions, LoadDriver, RunSummary, summarize
from fastroute.loadgen.summary import LatencySummary

__all__ = ["RouterResult", "run_bench", "build_workload", "build_sessions", "probe_sessions"]

#: How often the watcher checks that the router is still running, seconds.
WATCH_INTERVAL_S = 0.5


class RouterResult(msgspec.Struct, kw_only=True):
    """What one router did (``status`` != "ok": the figures are partial or absent)."""

    router: str
    status: str  # ok | unavailable | failed to start | died mid-run | error
    detail: str = ""
    summary: RunSummary | None = None
    engine_share: dict[str, float] = {}
    engine_requests: dict[str, float] = {}
    #: Each engine's ``vllm:prompt_tokens_total`` delta (prefill work, e.g. a hedge's cost).
    engine_prompt_tokens: dict[str, float] = {}
    #: Each engine's ``vllm:prefix_cache_queries_total`` delta: prompt tokens of every
    #: request scheduled, including those aborted before their first token.
    engine_scheduled_prompt_tokens: dict[str, float] = {}
    engine_cache_hit_rate: dict[str, float | None] = {}
    #: Each engine's mean share of the controller's LP allocation over the measured
    #: window (fastroute with its controller only; :mod:`fastroute.fleetbench.lp_share`).
    lp_share: dict[str, float] = {}
    cache_hit_rate: float | None = None
    router_cpu_s: float | None = None
    router_cpu_s_by_process: dict[str, float] = {}
    router_cpu_us_per_request: float | None = None
    router_cpu_us_per_token: float | None = None
    router_peak_rss_mb: float | None = None
    overhead_direct_ttft: LatencySummary | None = None
    overhead_router_ttft: LatencySummary | None = None
    overhead_added_p50_ms: float | None = None
    target_rps: float | None = None
    offered_rps: float | None = None
    elapsed_s: float = 0.0


def build_workload(spec: BenchSpec) -> Any:
    """The spec's :class:`~fastroute.workload.ChatWorkload`, its rate set from ``load``.

    With ``load`` the session rate is ``load × Σ capacity_rps / turns per session``,
    the turns per session measured on a long sample of the same workload (the context
    cap cuts sessions short, so the geometric mean alone would overshoot).
    """
    from fastroute.workload import ChatWorkload, generate_sessions

    workload = ChatWorkload.from_dict(spec.workload or {})
    if spec.load is None:
        return workload
    probe = msgspec.structs.replace(workload, rate_sessions_per_s=1.0)
    sample = generate_sessions(probe, duration_s=2000.0, seed=spec.seed + 7919)
    turns = sum(len(s.turns) for s in sample) / max(1, len(sample))
    target_rps = spec.load * spec.fleet.capacity_rps()
    return msgspec.structs.replace(workload, rate_sessions_per_s=target_rps / turns)


def build_sessions(spec: BenchSpec) -> tuple[list[Any], list[str], str]:
    """The spec's sessions (identical for every router), their sources and a description.

    From ``[replay]`` (:mod:`fastroute.fleetbench.replay`), ``[family]``
    (:mod:`fastroute.fleetbench.families`) or ``[workload]``.
    """
    if spec.family is not None:
        from fastroute.fleetbench.families import (
            describe_family,
            family_rate_rps,
            family_sessions_for,
        )

        sessions = family_sessions_for(spec)
        sources = [r.name for r in spec.fleet.regions]
        return sessions, sources, (
            f"family {describe_family(spec)}: {len(sessions)} sessions, "
            f"{sum(len(s.turns) for s in sessions)} requests at {family_rate_rps(spec):.3f} "
            f"req/s mean, from {', '.join(sources)}"
        )  # fmt: skip
    if spec.replay is not None:
        from fastroute.fleetbench.replay import (
            describe_mix,
            replay_rate_rps,
            replay_sessions,
            replay_sources,
        )

        sessions = replay_sessions(spec)
        sources = list(replay_sources(spec))
        return (
            sessions,
            sources,
            (
                f"replay: {len(sessions)} requests ({describe_mix(spec)}) at "
                f"{replay_rate_rps(spec):.3f} req/s mean, from {', '.join(sources)}"
            ),
        )
    from fastroute.workload import generate_sessions

    workload = build_workload(spec)
    sessions = generate_sessions(
        workload, duration_s=spec.warmup_s + spec.duration_s, seed=spec.seed
    )
    sources = [s.name for s in workload.sources]
    return sessions, sources, (
        f"workload: {len(sessions)} sessions, {sum(len(s.turns) for s in sessions)} turns, "
        f"{workload.rate_sessions_per_s:.3f} sessions/s from {', '.join(sources)}"
    )  # fmt: skip


def target_rps(spec: BenchSpec) -> float | None:
    """The offered request rate the spec asks for (None in closed loop)."""
    if spec.replay is not None:
        from fastroute.fleetbench.replay import replay_rate_rps

        return replay_rate_rps(spec)
    if spec.family is not None:
        from fastroute.fleetbench.families import family_rate_rps

        return family_rate_rps(spec)
    return None if spec.load is None else spec.load * spec.fleet.capacity_rps()


def probe_sessions(sources: Sequence[str], model: str, n: int, tag: str) -> list[Any]:
    """``n`` single-turn short sessions (unique texts, 8 output tokens), cycling ``sources``."""
    from fastroute.workload import Session, Turn

    return [
        Session(
            session_id=f"probe-{tag}-{i}",
            tenant="probe",
            source=sources[i % len(sources)],
            model=model,
            start_s=0.0,
            system_prompt="",
            turns=(Turn(user_text=f"probe {tag} {i}: say ok", user_tokens=6, max_tokens=8),),
        )
        for i in range(n)
    ]


async def _chat_ok(url: str, model: str) -> None:
    """Raise unless one chat request through ``url`` answers 200."""
    body = {"model": model, "messages": [{"role": "user", "content": "ready?"}], "max_tokens": 1}
    timeout = aiohttp.ClientTimeout(total=5.0)
    async with (
        aiohttp.ClientSession(timeout=timeout) as http,
        http.post(url + "/v1/chat/completions", json=body) as resp,
    ):
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}")


async def _wait_chat_ready(url: str, model: str, proc: ManagedProcess) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    last = ""
    while True:
        proc.check_alive()
        try:
            await _chat_ok(url, model)
            return
        except (aiohttp.ClientError, TimeoutError, RuntimeError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() > deadline:
            raise TimeoutError(f"{proc.name}: no 200 within {READY_TIMEOUT_S} s ({last})")
        await asyncio.sleep(0.2)


@dataclass
class _RouterRun:
    """The processes and URLs of a started router."""

    urls: dict[str, str | list[str]]
    processes: list[ManagedProcess] = field(default_factory=list)
    controller_url: str = ""


async def _start_router(
    plan: RouterPlan,
    spec: BenchSpec,
    procs: ProcessSet,
    engines: Sequence[PlannedEngine],
    sources: Sequence[str],
    run_dir: Path,
    prefix: str,
) -> _RouterRun:
    model = engines[0].model
    if plan.kind == "fastroute":
        slo = {m: (spec.slo.ttft_s, spec.slo.tbot_s) for m in spec.fleet.models}
        stack = FastrouteStack(
            procs, spec.fleet, engines, sources, run_dir, prefix,
            policy=plan.policy or DEFAULT_POLICY_NAME, policy_params=plan.params,
            hardware=plan.hardware, hedge=plan.hedge,
            period_s=spec.controller_period_s, controller_enabled=spec.controller, slo_s=slo,
            workers=plan.workers, proxies_per_source=plan.proxies, peers=plan.peers,
            proxy_settings=plan.proxy_settings,
        )  # fmt: skip
        await stack.start()
        for name, proc in stack.proxies.items():
            await _wait_chat_ready(stack.proxy_url(name), model, proc)
        return _RouterRun(dict(stack.source_urls), stack.processes, stack.controller_url)
    assert plan.template is not None
    run = _RouterRun({})
    started: list[tuple[ManagedProcess, str]] = []
    for source in sources:
        port = free_port()
        cmd = expand_command(
            plan.template, port=port, metrics_port=free_port(),
            worker_urls=[e.url for e in engines], policy=plan.policy,
        )  # fmt: skip
        safe = "".join(c if c.isalnum() else "-" for c in plan.name)
        proc = procs.start(f"{safe}-{source}", cmd)
        run.processes.append(proc)
        run.urls[source] = url = f"http://127.0.0.1:{port}"
        started.append((proc, url))
    for proc, url in started:
        await _wait_chat_ready(url, model, proc)
    return run


def _cpu(processes: Sequence[ManagedProcess]) -> dict[str, float]:
    return {p.name: session_cpu_s(p.pid) for p in processes}


async def _watch(processes: Sequence[ManagedProcess], on_death: Callable[[str], None]) -> None:
    while True:
        for proc in processes:
            if not proc.alive():
                on_death(f"{proc.name} exited with status {proc.proc.returncode}")
                return
        await asyncio.sleep(WATCH_INTERVAL_S)


async def _faults(spec: BenchSpec, engines: Sequence[PlannedEngine], log: list[str]) -> None:
    urls = {e.name: e.url for e in engines}
    t0 = time.monotonic()
    for fault in sorted(spec.faults, key=lambda f: f.at_s):
        await asyncio.sleep(max(0.0, t0 + fault.at_s - time.monotonic()))
        try:
            await set_fault(urls[fault.engine], fault.set)
            log.append(f"t={fault.at_s:g} s: {fault.engine} {fault.set}")
        except (RuntimeError, aiohttp.ClientError, TimeoutError) as exc:
            log.append(f"t={fault.at_s:g} s: fault on {fault.engine} failed: {exc}")


async def _overhead(
    spec: BenchSpec,
    engines: Sequence[PlannedEngine],
    urls: dict[str, str | list[str]],
    result: RouterResult,
) -> None:
    n = spec.overhead_requests
    if n == 0:
        return
    model = engines[0].model
    served = [e for e in engines if e.model == model]
    opts = DriveOptions(concurrency=1, max_in_flight=1, request_timeout_s=spec.request_timeout_s)
    direct = await LoadDriver({e.name: e.url for e in served}, opts).run(
        probe_sessions([e.name for e in served], model, n, "direct")
    )
    routed = await LoadDriver(urls, opts).run(probe_sessions(list(urls), model, n, "router"))
    d = summarize(direct.records, direct.wall_s).ttft
    r = summarize(routed.records, routed.wall_s).ttft
    result.overhead_direct_ttft, result.overhead_router_ttft = d, r
    if d.p50_s is not None and r.p50_s is not None:
        result.overhead_added_p50_ms = (r.p50_s - d.p50_s) * 1e3


async def run_router(
    plan: RouterPlan,
    spec: BenchSpec,
    sessions: Sequence[Any],
    sources: Sequence[str],
    work_dir: Path,
    *,
    say: Callable[[str], None] = print,
    records_out: dict[str, list[Any]] | None = None,
) -> RouterResult:
    """Run the spec through one router; never raises for the router's failures.

    ``records_out``, if given, receives the measured window's request records under the
    router name.
    """
    result = RouterResult(router=plan.name, status="ok")
    if plan.unavailable is not None:
        result.status, result.detail = "unavailable", plan.unavailable
        return result
    t_start = time.monotonic()
    prefix = run_prefix("bench")
    run_dir = work_dir / "".join(c if c.isalnum() else "-" for c in plan.name)
    run_dir.mkdir(parents=True, exist_ok=True)
    procs = ProcessSet(run_dir)
    try:
        _, engines = await _start_fleet(procs, spec.fleet, run_dir, seed=spec.seed)
        try:
            router = await _start_router(plan, spec, procs, engines, sources, run_dir, prefix)
        except (ProcessDiedError, TimeoutError, OSError, ValueError) as exc:
            result.status, result.detail = "failed to start", str(exc)[-1500:]
            return result
        await _overhead(spec, engines, router.urls, result)
        urls = {e.name: e.url for e in engines}
        warmup = spec.warmup_s
        driver = LoadDriver(
            router.urls,
            DriveOptions(
                stream=spec.stream, send_session_id=spec.send_session_id,
                concurrency=spec.concurrency, max_in_flight=spec.max_in_flight,
                duration_s=warmup + spec.duration_s, drain_s=spec.drain_s,
                max_requests=spec.max_requests, request_timeout_s=spec.request_timeout_s,
            ),
        )  # fmt: skip
        died: list[str] = []

        def on_death(why: str) -> None:
            died.append(why)
            driver.stop()

        fault_log: list[str] = []
        samplers = [RssSampler(p.pid) for p in router.processes]
        start: dict[str, Any] = {}

        lp = LpShareSampler(router.controller_url, spec.controller_period_s)

        async def window_start() -> None:
            # The measured window starts after the warm-up: counters are taken there.
            await asyncio.sleep(warmup)
            start["cpu"] = _cpu(router.processes)
            start["engines"] = await scrape_engines(urls)
            if router.controller_url:
                lp.start()

        if warmup == 0:
            await window_start()
        say(
            f"[{plan.name}] driving {len(sessions)} sessions for {warmup:g} s warm-up + "
            f"{spec.duration_s:g} s …"
        )
        with contextlib.ExitStack() as stack:
            for sampler in samplers:
                stack.enter_context(sampler)
            watch = asyncio.create_task(_watch(router.processes, on_death))
            faults = asyncio.create_task(_faults(spec, engines, fault_log))
            starter = asyncio.create_task(window_start()) if warmup > 0 else None
            try:
                drive = await driver.run(sessions)
            finally:
                watch.cancel()
                faults.cancel()
            if starter is not None and not starter.done():
                starter.cancel()  # the run ended inside the warm-up (the router died)
                start.setdefault("cpu", _cpu(router.processes))
                start.setdefault("engines", {})
            cpu1 = _cpu(router.processes)
            result.lp_share = lp.stop()
        after = await scrape_engines(urls)
        window = [r for r in drive.records if r.sent_at_s >= warmup]
        if records_out is not None:
            records_out[plan.name] = window
        summary = summarize(
            window, max(0.0, drive.wall_s - warmup),
            ttft_slo_s=spec.slo.ttft_s, tbot_slo_s=spec.slo.tbot_s,
        )  # fmt: skip
        result.summary = summary
        result.offered_rps = summary.requests / spec.duration_s
        result.target_rps = target_rps(spec)
        _engine_figures(result, start["engines"], after)
        cpu0 = start["cpu"]
        by_process = {name: max(0.0, cpu1[name] - cpu0[name]) for name in cpu1}
        cpu = sum(by_process.values())
        result.router_cpu_s = cpu
        result.router_cpu_s_by_process = by_process
        if summary.requests:
            result.router_cpu_us_per_request = cpu / summary.requests * 1e6
        if summary.output_tokens:
            result.router_cpu_us_per_token = cpu / summary.output_tokens * 1e6
        result.router_peak_rss_mb = sum(s.peak_bytes for s in samplers) / 2**20
        if fault_log:
            result.detail = "; ".join(fault_log)
        if died:
            result.status = "died mid-run"
            result.detail = "; ".join([*died, *fault_log])
    except (ProcessDiedError, TimeoutError, OSError) as exc:
        result.status, result.detail = "error", str(exc)[-1500:]
    finally:
        await asyncio.to_thread(procs.stop_all)
        remove_segments(prefix)
        result.elapsed_s = time.monotonic() - t_start
    return result


def _engine_figures(
    result: RouterResult,
    before: dict[str, EngineCounters | None],
    after: dict[str, EngineCounters | None],
) -> None:
    deltas = {name: c.minus(before.get(name)) for name, c in after.items() if c is not None}
    total = sum(d.requests for d in deltas.values())
    result.engine_requests = {n: d.requests for n, d in deltas.items()}
    result.engine_prompt_tokens = {n: d.prompt_tokens for n, d in deltas.items()}
    result.engine_scheduled_prompt_tokens = {n: d.prefix_queries_tokens for n, d in deltas.items()}
    result.engine_share = {n: (d.requests / total if total else 0.0) for n, d in deltas.items()}
    result.engine_cache_hit_rate = {n: d.hit_rate for n, d in deltas.items()}
    queries = sum(d.prefix_queries_tokens for d in deltas.values())
    hits = sum(d.prefix_hits_tokens for d in deltas.values())
    result.cache_hit_rate = hits / queries if queries else None


async def run_bench(
    spec: BenchSpec,
    work_dir: Path,
    *,
    routers: Sequence[str] | None = None,
    say: Callable[[str], None] = print,
    records_out: dict[str, list[Any]] | None = None,
) -> list[RouterResult]:
    """Run ``spec`` through each router (``routers`` overrides the spec's list)."""
    plans = [
        resolve_router(name, spec.router_commands, spec.fastroute_variants)
        for name in (routers or spec.routers)
    ]
    sessions, sources, description = build_sessions(spec)
    say(description)
    results = []
    for plan in plans:
        say(f"[{plan.name}] starting …")
        result = await run_router(
            plan, spec, sessions, sources, work_dir, say=say, records_out=records_out
        )
        say(f"[{plan.name}] {result.status} ({result.elapsed_s:.0f} s) {result.detail[:300]}")
        results.append(result)
    return results
