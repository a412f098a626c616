"""``fastroute bench chaos``: a fleet under steady load while a seeded schedule injects faults.

The fleet: ``engines`` emulated engines, each its own process (so one can be SIGKILLed), the
controller, and one proxy (``fastroute serve --workers 2``: a supervisor and its workers).
``concurrency`` closed-loop clients send streamed chats (:mod:`fastroute.fleetbench.chaos_load`)
for ``duration_s`` while :func:`~fastroute.fleetbench.chaos_faults.schedule` injects one fault
at a time. Every request is accounted for (completed, completed after migration, failed with a
reason, corrupt) and attributed to the fault active while it ran ("none" when none was).

Verdict ``pass`` when no request is corrupt and every failure is *excused*: one fault at a time
leaves at least ``engines - 1`` engines serving, so the only failures excused are requests whose
proxy worker was SIGKILLed under them (the router process itself died; the client's next attempt
is served). Everything else that failed could have been served by another engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from fastroute.fleetbench.chaos_faults import (
    ENGINE_FAULTS,
    FAULT_KINDS,
    FaultEvent,
    engine_fault_body,
    kill_one_worker,
    schedule,
    worker_pids,
)
from fastroute.fleetbench.chaos_load import ChaosTarget, Outcome, run_request
from fastroute.fleetbench.process import (
    ManagedProcess,
    ProcessSet,
    free_port,
    kill_group,
    wait_http_ok,
)
from fastroute.fleetbench.soak import ResourceSample, leak_report, sample_forever, write_plot

__all__ = ["ChaosOptions", "ChaosRun", "FleetShape", "markdown", "run_chaos", "summarize"]

MODEL = "chaos-8b"
#: Bound on a process becoming ready, seconds (a restarted engine or controller too).
READY_TIMEOUT_S = 60.0
#: Proxy workers: at least two, so one can be SIGKILLed while the other serves.
WORKERS = 2


@dataclass(frozen=True)
class ChaosOptions:
    """A chaos run's parameters (``fastroute bench chaos`` options).

    Attributes
    ----------
    duration_s : float
        Load and faults this long (the issue's figure: ≥ 600).
    seed : int
        Seeds the schedule and the choice of targets.
    engines : int
        Emulated engines (≥ 2).
    concurrency : int
        Closed-loop clients.
    max_tokens : int
        Output tokens asked per request (long enough that a kill lands mid-stream).
    kinds : tuple of str
        Fault kinds in the schedule.
    warmup_s, gap_s : float
        Calm before the first fault (the controller's first plans, warm engines) and between
        two faults (the fleet recovers: engines restarted, ejections expired).
    fresh_connections : bool
        Each request on a new connection (the soak: connections churn, and the proxy's
        ``SO_REUSEPORT`` spreads them over the workers; a few long-lived keep-alive
        connections can all land on one worker and stay there).
    sample_interval_s : float or None
        The soak: sample every process's RSS, open fds and event-loop tasks this often, and
        fit their slopes (:mod:`fastroute.fleetbench.soak`); None: no sampling.
    """

    duration_s: float = 600.0
    seed: int = 0
    engines: int = 4
    concurrency: int = 6
    max_tokens: int = 160
    kinds: tuple[str, ...] = FAULT_KINDS
    warmup_s: float = 20.0
    gap_s: float = 10.0
    fresh_connections: bool = False
    sample_interval_s: float | None = None


@dataclass(frozen=True)
class FleetShape:
    """What other runs on the chaos fleet change (the overload benchmark: classes, a capacity).

    Attributes
    ----------
    capacity_rps : float
        Each engine's ``capacity_rps`` in the config (the controller plans with it).
    engine_args : tuple of str
        Extra ``fastroute engine`` options (e.g. ``--max-num-seqs 8``).
    extra_toml : str
        Appended to the config (e.g. ``[[classes]]`` tables).
    """

    capacity_rps: float = 10.0
    engine_args: tuple[str, ...] = ()
    extra_toml: str = ""


def _config(engine_urls: list[str], ports: tuple[int, int], tag: str, shape: FleetShape) -> str:
    controller_port, proxy_port = ports
    engines = "".join(
        f'[[engines]]\nname = "e{k}"\nurl = "{url}"\nmodels = ["{MODEL}"]\nhardware = "h100"\n'
        f"capacity_rps = {shape.capacity_rps!r}\n\n"
        for k, url in enumerate(engine_urls)
    )
    return (
        engines
        + f"[controller]\nport = {controller_port}\nperiod_s = 1.0\nsolve_time_limit_s = 0.5\n"
        + "scrape_interval_s = 1.0\n"
        + "scrape_timeout_s = 0.8\n\n"
        + f"[proxy]\nport = {proxy_port}\nworkers = {WORKERS}\n"
        + f'table_name = "{tag}-weights"\nstats_name = "{tag}-stats"\n'
        + shape.extra_toml
    )


@dataclass
class ChaosRun:
    """The fleet of one chaos run and the faults applied to it."""

    options: ChaosOptions
    run_dir: Path
    shape: FleetShape = field(default_factory=FleetShape)
    procs: ProcessSet = field(init=False)
    engine_ports: list[int] = field(default_factory=list)
    engines: list[ManagedProcess | None] = field(default_factory=list)
    controller: ManagedProcess | None = None
    proxy: ManagedProcess | None = None
    config_path: Path = field(init=False)
    proxy_url: str = ""
    controller_url: str = ""
    restarts: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.procs = ProcessSet(self.run_dir)
        self.config_path = self.run_dir / "fastroute.toml"
        # the run's shared memory (table, stats, tenant counters) in its own directory, so no
        # table of a finished run is left in /dev/shm for a later proxy to find
        self.shm_dir = self.run_dir / "shm"
        self.shm_dir.mkdir(parents=True, exist_ok=True)
        self.env = {"FASTROUTE_SHM_DIR": str(self.shm_dir)}

    def _cmd(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "fastroute", "--log-level", "WARNING", *args]

    def _engine_url(self, k: int) -> str:
        return f"http://127.0.0.1:{self.engine_ports[k]}"

    async def _start_engine(self, k: int) -> None:
        self.restarts[f"e{k}"] += 1
        proc = self.procs.start(
            f"engine-e{k}-{self.restarts[f'e{k}']}",
            self._cmd("engine", "--count", "1", "--base-port", str(self.engine_ports[k]),
                      "--profile", "h100", "--model", MODEL, "--name-prefix", f"e{k}",
                      "--seed", str(k), *self.shape.engine_args),
        )  # fmt: skip
        self.engines[k] = proc
        await wait_http_ok(self._engine_url(k) + "/health", timeout_s=READY_TIMEOUT_S, process=proc)

    async def _start_controller(self) -> None:
        self.controller = self.procs.start(
            f"controller-{self.restarts['controller']}",
            self._cmd("controller", "--config", str(self.config_path)),
            env=self.env,
        )
        self.restarts["controller"] += 1
        await wait_http_ok(
            self.controller_url + "/health", timeout_s=READY_TIMEOUT_S, process=self.controller
        )

    async def start(self) -> None:
        """Engines, then the controller (it must publish first), then the proxy."""
        n = self.options.engines
        self.engine_ports = [free_port() for _ in range(n)]
        self.engines = [None] * n
        controller_port, proxy_port = free_port(), free_port()
        self.controller_url = f"http://127.0.0.1:{controller_port}"
        self.proxy_url = f"http://127.0.0.1:{proxy_port}"
        tag = f"fastroute-chaos-{os.getpid()}"
        urls = [self._engine_url(k) for k in range(n)]
        self.config_text = _config(urls, (controller_port, proxy_port), tag, self.shape)
        self.config_path.write_text(self.config_text)
        await asyncio.gather(*(self._start_engine(k) for k in range(n)))
        await self._start_controller()
        serve = self._cmd("serve", "--config", str(self.config_path))
        self.proxy = self.procs.start("proxy", serve, env=self.env)
        await wait_http_ok(self.proxy_url + "/ready", timeout_s=READY_TIMEOUT_S, process=self.proxy)

    async def _engine_fault(self, k: int, body: dict[str, object] | None) -> None:
        timeout = aiohttp.ClientTimeout(total=5.0)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            url = self._engine_url(k) + "/admin/fault"
            request = http.delete(url) if body is None else http.post(url, json=body)
            async with request as resp:
                if resp.status != 200:
                    raise RuntimeError(f"engine e{k} refused fault {body}: HTTP {resp.status}")

    async def inject(self, event: FaultEvent, rng: random.Random) -> str:
        """Apply ``event``; a short note of what was done."""
        kind, k = event.kind, event.target
        if kind in ENGINE_FAULTS:
            await self._engine_fault(k, engine_fault_body(kind))
            return f"e{k}: {engine_fault_body(kind)}"
        if kind == "engine_sigkill":
            proc = self.engines[k]
            assert proc is not None
            kill_group(proc.proc)
            self.procs.processes.remove(proc)
            return f"e{k}: SIGKILL pid {proc.pid}"
        if kind == "controller_kill":
            assert self.controller is not None
            kill_group(self.controller.proc)
            self.procs.processes.remove(self.controller)
            return f"controller: SIGKILL pid {self.controller.pid}"
        assert self.proxy is not None
        if kind == "worker_kill":
            return f"proxy worker: SIGKILL pid {kill_one_worker(self.proxy.pid, rng)}"
        self.config_path.write_text("[proxy\nthis is not TOML = \n")  # broken_reload
        os.kill(self.proxy.pid, signal.SIGHUP)
        return "proxy: invalid TOML, SIGHUP"

    async def clear(self, event: FaultEvent) -> None:
        """Undo ``event`` (restart what was killed, restore the config)."""
        kind, k = event.kind, event.target
        if kind == "refuse":
            await wait_http_ok(self._engine_url(k) + "/health", timeout_s=READY_TIMEOUT_S)
        elif kind in ENGINE_FAULTS:
            await self._engine_fault(k, None)
        elif kind == "engine_sigkill":
            await self._start_engine(k)
        elif kind == "controller_kill":
            await self._start_controller()
        elif kind == "broken_reload":
            assert self.proxy is not None
            self.config_path.write_text(self.config_text)
            os.kill(self.proxy.pid, signal.SIGHUP)

    def pids(self) -> list[tuple[str, int]]:
        """(role, pid) of every process alive now: proxy supervisor and workers, controller,
        engines."""
        out: list[tuple[str, int]] = []
        if self.proxy is not None:
            out.append(("proxy-supervisor", self.proxy.pid))
            out += [("proxy-worker", pid) for pid in worker_pids(self.proxy.pid)]
        if self.controller is not None and self.controller.alive:
            out.append(("controller", self.controller.pid))
        out += [(f"engine-e{k}", e.pid) for k, e in enumerate(self.engines) if e and e.alive]
        return out

    def check_router_alive(self) -> None:
        """The proxy's supervisor must survive every fault (its workers may be restarted)."""
        assert self.proxy is not None
        self.proxy.check_alive()


async def _clients(run: ChaosRun, t0: float, stop: asyncio.Event) -> list[Outcome]:
    target = ChaosTarget(run.proxy_url, MODEL, run.options.max_tokens)
    outcomes: list[Outcome] = []
    counter = iter(range(1 << 40))
    timeout = aiohttp.ClientTimeout(total=120.0)

    async def client() -> None:
        connector = aiohttp.TCPConnector(force_close=run.options.fresh_connections)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
            while not stop.is_set():
                outcomes.append(await run_request(http, target, next(counter), t0))

    await asyncio.gather(*(client() for _ in range(run.options.concurrency)))
    return outcomes


async def _faults(run: ChaosRun, events: list[FaultEvent], t0: float, log: list[dict]) -> None:
    rng = random.Random(run.options.seed + 1)
    for event in events:
        await asyncio.sleep(max(0.0, t0 + event.start_s - time.monotonic()))
        note = await run.inject(event, rng)
        log.append({**asdict(event), "note": note, "at_s": time.monotonic() - t0})
        await asyncio.sleep(max(0.0, t0 + event.end_s - time.monotonic()))
        await run.clear(event)
        run.check_router_alive()


def _fault_of(outcome: Outcome, events: list[FaultEvent]) -> str:
    """The fault active while ``outcome`` ran (the first that overlaps it), else ``none``."""
    for event in events:
        if outcome.start_s < event.end_s and outcome.end_s > event.start_s:
            return event.kind
    return "none"


def summarize(outcomes: list[Outcome], events: list[FaultEvent]) -> dict:
    """Faults × outcome counts, the failure reasons, and the verdict (module docstring)."""
    table: dict[str, Counter[str]] = {}
    reasons: dict[str, Counter[str]] = {}
    unexcused = 0
    for o in outcomes:
        fault = _fault_of(o, events)
        result = "migrated" if o.result == "completed" and o.migrated else o.result
        table.setdefault(fault, Counter())[result] += 1
        if o.result != "completed":
            reasons.setdefault(fault, Counter())[o.reason[:80]] += 1
            excused = fault == "worker_kill" and o.reason.startswith("connection")
            unexcused += 0 if excused else 1
    corrupt = sum(c["corrupt"] for c in table.values())
    return {
        "requests": len(outcomes),
        "table": {k: dict(v) for k, v in sorted(table.items())},
        "reasons": {k: dict(v.most_common(5)) for k, v in sorted(reasons.items())},
        "unexcused_failures": unexcused,
        "corrupt": corrupt,
        "verdict": "pass" if unexcused == 0 and corrupt == 0 else "fail",
    }


def markdown(summary: dict) -> str:
    """The faults × outcomes table and the verdict, as markdown."""
    cols = ("completed", "migrated", "failed", "corrupt")
    lines = ["| fault | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for fault, counts in summary["table"].items():
        lines.append(f"| {fault} | " + " | ".join(str(counts.get(c, 0)) for c in cols) + " |")
    lines.append("")
    lines.append(
        f"{summary['requests']} requests; unexcused failures {summary['unexcused_failures']}; "
        f"corrupt {summary['corrupt']}; verdict **{summary['verdict']}**"
    )
    if "resources" in summary:
        lines += ["", "| process | resource | mean | slope per hour (± 95 %) | growth | leak |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for r in summary["resources"]:
            lines.append(
                f"| {r['role']} {r['pid'] or ''} | {r['resource']} | {r['mean']:.4g} | "
                f"{r['slope_per_h']:+.3g} ± {r['ci95_per_h']:.2g} | {r['growth']:+.1%} | "
                f"{'**yes**' if r['leak'] else 'no'} |"
            )
        lines.append(f"\nleaks: {summary['leaks']}")
    return "\n".join(lines) + "\n"


def _sampler(run: ChaosRun, t0: float, out: list[ResourceSample]) -> asyncio.Task | None:
    if run.options.sample_interval_s is None:
        return None

    def gauges() -> list[tuple[str, int, str, str]]:
        ctl = run.controller
        now = [("proxy-worker", 0, run.proxy_url, "fastroute_proxy_asyncio_tasks")]
        if ctl is not None and ctl.alive:
            now.append(
                ("controller", ctl.pid, run.controller_url, "fastroute_controller_asyncio_tasks")
            )
        return now

    return asyncio.create_task(
        sample_forever(run.pids, gauges, out, t0, run.options.sample_interval_s)
    )


async def _drive(run: ChaosRun, events: list[FaultEvent], log: list[dict]) -> tuple[list, list]:
    """Load, faults and (for a soak) samples for ``duration_s``; the outcomes and samples."""
    t0, stop, samples = time.monotonic(), asyncio.Event(), []
    clients = asyncio.create_task(_clients(run, t0, stop))
    sampler = _sampler(run, t0, samples)
    try:
        await asyncio.wait_for(_faults(run, events, t0, log), run.options.duration_s + 120)
        await asyncio.sleep(max(0.0, t0 + run.options.duration_s - time.monotonic()))
    finally:
        stop.set()
        if sampler is not None:
            sampler.cancel()
        outcomes = await clients
    return outcomes, samples


async def run_chaos(options: ChaosOptions, out_dir: Path) -> dict:
    """Run the fleet, the clients and the schedule; write ``results.json`` and ``results.md``
    (and, for a soak, ``resources.jsonl`` and the leak rows in ``results.json``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    events = schedule(
        options.seed, options.duration_s, options.engines, warmup_s=options.warmup_s,
        gap_s=options.gap_s, kinds=options.kinds,
    )  # fmt: skip
    run = ChaosRun(options, out_dir)
    fault_log: list[dict] = []
    with run.procs:
        await run.start()
        outcomes, samples = await _drive(run, events, fault_log)
    summary = summarize(outcomes, events) | {"options": asdict(options), "faults": fault_log}
    if options.sample_interval_s is not None:
        rows = leak_report(samples, options.duration_s)
        summary |= {"resources": rows, "leaks": sum(bool(r["leak"]) for r in rows)}
        lines = "".join(json.dumps(asdict(s)) + "\n" for s in samples)
        (out_dir / "resources.jsonl").write_text(lines)
        summary["plot"] = write_plot(samples, out_dir / "resources.png")
    (out_dir / "results.json").write_text(json.dumps(summary, indent=1, default=str))
    (out_dir / "outcomes.jsonl").write_text("".join(json.dumps(asdict(o)) + "\n" for o in outcomes))
    (out_dir / "results.md").write_text(markdown(summary))
    return summary
