"""``fastroute demo``: the whole system on loopback, a short load, a summary, cleanup.

Order: emulated fleet (one process, eight engines) → controller (must publish its
first table) → one proxy per source cluster → traffic → summary → stop everything.
The processes run in their own sessions and are stopped by process group (SIGTERM,
then SIGKILL after a bound); the run's shared-memory segments all carry a run-unique
prefix and are removed at the end, the controller's weight table included.

Signals: the first SIGINT/SIGTERM while traffic runs ends the traffic early (the
summary still prints); during start-up, or a second one, aborts. With ``--keep`` the
system stays up after the summary until a signal.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastroute.demo import report
from fastroute.demo.scenario import DEMO_FLEET, MODELS, SLO_S, SOURCES, demo_workload
from fastroute.fleetbench.fleet import PlannedEngine, set_fault
from fastroute.fleetbench.process import ProcessDiedError, ProcessSet
from fastroute.fleetbench.scrape import fetch_json, scrape_engines, scrape_proxies
from fastroute.fleetbench.stack import FastrouteStack, remove_segments, run_prefix, start_fleet
from fastroute.loadgen import DriveOptions, LoadDriver, RequestRecord, summarize
from fastroute.workload import generate_sessions

__all__ = ["DemoOptions", "run_demo", "FAULTS"]

#: ``--fault`` kinds → the emulator fault applied to one engine halfway through.
FAULTS: dict[str, dict[str, object]] = {
    "slow": {"slowdown": 3.0},
    "errors": {"error_rate": 0.5, "error_status": 503},
}
#: How long requests in flight at the end may finish, seconds.
DRAIN_S = 5.0
#: Seconds between progress lines.
PROGRESS_S = 5.0


@dataclass
class DemoOptions:
    """``fastroute demo``'s options (see :mod:`fastroute.demo.cli`)."""

    duration_s: float = 60.0
    keep: bool = False
    fault: str | None = None
    fault_engine: str = "h100-llama-0"
    seed: int = 0
    rate_sessions_per_s: float = 6.0
    log_level: str = "WARNING"


@dataclass
class _State:
    driver: LoadDriver | None = None
    keep_waiting: asyncio.Event | None = None
    signals: int = 0
    interrupted: bool = False
    records: list[RequestRecord] = field(default_factory=list)


def _say(text: str) -> None:
    print(text, flush=True)


async def _progress(state: _State, t0: float) -> None:
    while True:
        await asyncio.sleep(PROGRESS_S)
        recs = state.records
        ok = sum(1 for r in recs if r.ok)
        sent = state.driver.requests_sent if state.driver else 0
        _say(f"  t={time.monotonic() - t0:4.0f} s  sent {sent}  done {len(recs)}  ok {ok}")


async def _apply_fault(options: DemoOptions, engine: PlannedEngine, delay_s: float) -> str:
    await asyncio.sleep(delay_s)
    changes = FAULTS[options.fault or ""]
    await set_fault(engine.url, changes)
    note = f"{options.fault} ({changes}) on {engine.name} from t={delay_s:.0f} s"
    _say(f"  fault: {note}")
    return note


async def _demo(options: DemoOptions, procs: ProcessSet, run_dir: Path, prefix: str) -> int:
    state = _State()
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    assert main_task is not None

    def on_signal() -> None:
        state.signals += 1
        state.interrupted = True
        if state.keep_waiting is not None:
            state.keep_waiting.set()
        elif state.driver is not None and state.signals == 1:
            _say("  interrupted: stopping the traffic (again to abort)")
            state.driver.stop()
        else:
            main_task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)

    _say(f"fastroute demo: run {prefix}, logs in {run_dir}")
    _say("starting 8 emulated engines (4 × H100 us-east, 4 × A40 eu-west, 2 models) …")
    fleet_proc, engines = await start_fleet(procs, DEMO_FLEET, run_dir, seed=options.seed)
    _say("starting the controller and one proxy per source cluster (us-east, eu-west) …")
    stack = FastrouteStack(
        procs, DEMO_FLEET, engines, SOURCES, run_dir, prefix,
        period_s=5.0, slo_s=SLO_S, log_level=options.log_level,
    )  # fmt: skip
    proxy_urls = await stack.start()
    sessions = generate_sessions(
        demo_workload(options.rate_sessions_per_s),
        duration_s=options.duration_s,
        seed=options.seed,
    )
    _say(
        f"driving {len(sessions)} chat sessions from both clusters for "
        f"{options.duration_s:.0f} s (streaming, open loop) …"
    )
    driver = LoadDriver(
        proxy_urls,
        DriveOptions(
            duration_s=options.duration_s, drain_s=DRAIN_S, max_in_flight=256,
            send_session_id=True, request_timeout_s=60.0,
        ),
        on_record=state.records.append,
    )  # fmt: skip
    state.driver = driver
    t0 = time.monotonic()
    progress = asyncio.create_task(_progress(state, t0))
    fault_task: asyncio.Task[str] | None = None
    if options.fault:
        target = next((e for e in engines if e.name == options.fault_engine), None)
        if target is None:
            raise ValueError(
                f"--fault-engine {options.fault_engine!r}: no such engine "
                f"(one of {', '.join(e.name for e in engines)})"
            )
        fault_task = asyncio.create_task(_apply_fault(options, target, options.duration_s / 2))
    try:
        result = await driver.run(sessions)
    finally:
        progress.cancel()
        state.driver = None
    fault_note = None
    if fault_task is not None:
        if fault_task.done() and not fault_task.cancelled() and fault_task.exception() is None:
            fault_note = fault_task.result()
        else:
            fault_task.cancel()
            fault_note = f"{options.fault}: not applied (the run ended first)"
    engine_counters = await scrape_engines({e.name: e.url for e in engines})
    proxy_counters = await scrape_proxies(proxy_urls)
    plan = await fetch_json(stack.controller_url + "/v1/plan")
    procs.check_alive()
    summary = summarize(result.records, result.wall_s, ttft_slo_s=1.0, tbot_slo_s=0.1)
    _say("")
    _say(
        f"Summary: {result.wall_s:.0f} s, {result.sessions_started} sessions, "
        f"seed {options.seed}" + (" (stopped early)" if result.stopped_early else "")
    )
    _say(report.summary_table(summary, engines, engine_counters, proxy_counters,
                              fault_note=fault_note))  # fmt: skip
    _say(report.plan_text(plan))
    if why := report.why_text(plan):
        _say(why)
    _say(f"SLOs: TTFT ≤ {SLO_S[MODELS[0]][0]:g} s, TBOT ≤ {SLO_S[MODELS[0]][1]:g} s")
    _say("")
    _say(report.urls_text(proxy_urls, stack.controller_url, engines))
    if options.keep and not state.interrupted:
        _say("")
        _say(report.keep_text(proxy_urls[SOURCES[0]], MODELS[0], stack.table_name))
        state.keep_waiting = asyncio.Event()
        watch = asyncio.create_task(_watch(procs, state.keep_waiting))
        try:
            await state.keep_waiting.wait()
        finally:
            watch.cancel()
        procs.check_alive()
    del fleet_proc
    return 0


async def _watch(procs: ProcessSet, done: asyncio.Event) -> None:
    """With ``--keep``: end the wait if a process dies (the error is raised by the caller)."""
    while not done.is_set():
        try:
            procs.check_alive()
        except ProcessDiedError:
            done.set()
            return
        await asyncio.sleep(1.0)


def run_demo(options: DemoOptions) -> int:
    """Run the demo; return the exit status (0 done, 1 failed, 130 aborted)."""
    import uvloop

    prefix = run_prefix("demo")
    run_dir = Path(tempfile.mkdtemp(prefix=prefix + "-"))
    procs = ProcessSet(run_dir)
    status = 1
    try:
        status = uvloop.run(_demo(options, procs, run_dir, prefix))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("fastroute demo: aborted", file=sys.stderr)
        status = 130
    except (ProcessDiedError, TimeoutError, OSError, ValueError) as exc:
        print(f"fastroute demo: {exc}", file=sys.stderr)
        status = 1
    finally:
        # A Ctrl-C now must not interrupt the cleanup half-way (it is bounded anyway).
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            _say("stopping every process …")
            procs.stop_all()
            removed = remove_segments(prefix)
            _say(f"stopped; removed shared memory: {', '.join(removed) or 'none'}")
        finally:
            signal.signal(signal.SIGINT, previous)
        if status == 0:
            shutil.rmtree(run_dir, ignore_errors=True)
        else:
            print(f"fastroute demo: logs kept in {run_dir}", file=sys.stderr)
            with contextlib.suppress(OSError):
                for log in sorted(run_dir.glob("*.log")):
                    tail = log.read_text(errors="replace")[-1500:]
                    if tail.strip():
                        print(f"--- {log.name} (end) ---\n{tail}", file=sys.stderr)
    return status
