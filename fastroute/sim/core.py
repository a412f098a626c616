"""The discrete-event simulator: one event per engine step, a virtual clock, a heap.

Events are ``(time, kind, sequence, a, b)`` tuples in a :mod:`heapq`; ties on time are
broken by kind (control before pulls before faults before client sends before engine
arrivals before responses before steps), then by insertion order, so a run is a pure
function of (scenario, policy, seed).

Engines are :class:`~fastroute.emulator.model.EngineModel` instances driven through
``submit`` / ``step`` / ``next_step_time`` / ``cancel`` / ``claim_transfer``. An engine
with work has exactly one pending step event. **Decode fast-forward**: after a step,
if the engine's next step starts before every other pending event, it runs at once
without going through the heap (no push, no pop), repeatedly, until another event is
due first or the engine goes idle — in a decode-heavy regime most steps never touch
the heap. Tokens are never events.

Request path (per data plane = per region): client sends turn → sticky shed check
(controller's fraction) → queue-delay guard (optional) → ``policy.choose`` on the
pulled table → attempt sent over the region×region network → engine (or connect
error / 429 / 5xx at its first token) → response back to the data plane → outcome to
the policy hooks, the outlier detector and the retry budget → retry on the next
untried engine of the failover ranking, or done; a served turn schedules the
session's next turn after its think time.
"""

from __future__ import annotations

import dataclasses
import heapq
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from fastroute.emulator.model import (
    EngineConfig,
    QueueFullError,
    Request,
    RequestTooLongError,
)
from fastroute.emulator.profiles import true_profile
from fastroute.guards.admission import Verdict, should_shed
from fastroute.guards.outlier import Outcome
from fastroute.hardware import get_profile
from fastroute.hashing import PROMPT_KEY_PREFIX_BYTES, key_hash
from fastroute.hashing import engine_id as make_engine_id
from fastroute.policy import RouteRequest
from fastroute.policy.marginal import REASON_SLO_INFEASIBLE, MarginalRequest, StateColumn
from fastroute.predict.calibration import datasheet_profile
from fastroute.predict.step_time import NominalStepTimes
from fastroute.sim.capacity import idle_latencies, request_shapes, saturation_capacity_rps
from fastroute.sim.control import ControlInput, ControlOutput, EngineWindow, Optimiser
from fastroute.sim.fleet import DataPlane, ProxyLoads, SimEngine, engine_load
from fastroute.sim.hedging import HedgeDelays
from fastroute.sim.records import RequestRecord
from fastroute.sim.scenario import Scenario, ScenarioError
from fastroute.workload import Burst, Session, SessionPrompts, generate_sessions, load_trace
from fastroute.workload.session import reply_text

__all__ = ["Simulator", "SimResult", "ControlSample", "prepare_sessions"]

# Event kinds, in tie-break order.
K_CONTROL, K_PULL, K_FAULT, K_TURN, K_ARRIVE, K_TRANSFER, K_RESPONSE, K_STEP, K_HEDGE, K_POLL = (
    range(10)
)
# EngineState columns, as plain ints for the event loop.
_Q_TOK = int(StateColumn.QUEUED_PREFILL_TOKENS)
_Q_REQ = int(StateColumn.QUEUED_REQUESTS)
_B = int(StateColumn.RUNNING_SEQS)
_S = int(StateColumn.RUNNING_CONTEXT_TOKENS)
_KV_USED = int(StateColumn.KV_USED_TOKENS)
_KV_CAP = int(StateColumn.KV_CAPACITY_TOKENS)
_NET = int(StateColumn.NETWORK_S)
_MIX = int(StateColumn.PREFILL_TOKENS_PER_STEP)
_FAILURE_REASON = {
    Outcome.HTTP_5XX: "http-5xx",
    Outcome.CONNECT_ERROR: "connect-error",
    Outcome.TIMEOUT: "timeout",
    Outcome.RATE_LIMITED: "http-429",
    Outcome.CLIENT_ERROR: "http-400",
}
_ENGINE_FAULTS = (Outcome.HTTP_5XX, Outcome.CONNECT_ERROR, Outcome.TIMEOUT)
_capacity_cache: dict[tuple[Any, ...], float] = {}


@dataclass
class ControlSample:
    """One control step: the table published and what it cost."""

    t_s: float
    weights: np.ndarray
    shed_fraction: np.ndarray
    demand_rps: np.ndarray
    churn: float
    optimiser_wall_s: float
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class SimResult:
    """Everything a run produced.

    Attributes
    ----------
    records : list of RequestRecord
        One per request that arrived after the warm-up.
    control : list of ControlSample
        The published tables, in time order.
    engines : list of dict
        Per engine: name, region, role, capacity, utilisation, steps, preemptions,
        prefix-cache hit rate.
    class_labels : tuple of str
        Row labels of the weight tables.
    engine_names : tuple of str
    horizon_s : float
        Virtual time simulated.
    events : int
        Events processed (heap events + fast-forwarded steps).
    heap_events : int
        Events that went through the heap.
    steps : int
        Engine steps.
    wall_s : float
        Wall time of :meth:`Simulator.run`.
    """

    records: list[RequestRecord]
    control: list[ControlSample]
    engines: list[dict[str, Any]]
    class_labels: tuple[str, ...]
    engine_names: tuple[str, ...]
    horizon_s: float
    events: int
    heap_events: int
    steps: int
    wall_s: float


class _Session:
    """A session in flight: its prompts (incrementally hashed) and its region's data plane."""

    __slots__ = ("session", "prompts", "dp")

    def __init__(self, session: Session, dp: DataPlane) -> None:
        self.session = session
        self.prompts = SessionPrompts(session)
        self.dp = dp


class _Req:
    __slots__ = (
        "rid",
        "sess",
        "turn",
        "row",
        "decode_row",
        "route",
        "prompt",
        "max_tokens",
        "arrival_s",
        "attempts",
        "tried",
        "decision",
        "decode_ranked",
        "ticket",
        "holds_slot",
        "record",
        "done",
        "sent_tokens",
        "first_token_at",
        "legs",
    )


class _Attempt:
    __slots__ = (
        "req",
        "n",
        "engine",
        "decode_engine",
        "sent_s",
        "fail_first",
        "mreq",
        "first_token_s",
        "mix_mark",
        "phase",
        "failed",
        "generation",
        "p_open",
        "d_open",
        "load0",
        "dload0",
        "prefill_end_s",
        "prefill_cached",
        "decode_route",
        "cancelled",
        "queued",
    )


def prepare_sessions(scenario: Scenario, seed: int) -> tuple[list[Session], float]:
    """The scenario's sessions (generated or replayed) and its session rate.

    ``spike`` faults become workload bursts; ``target_load`` is applied by the
    simulator (it needs capacities), so this uses the workload's own rate.
    """
    if scenario.family is not None:
        from fastroute.workload.family_gen import family_sessions

        sessions = family_sessions(
            scenario.family,
            duration_s=scenario.duration_s,
            sources=tuple(r.name for r in scenario.regions),
            seed=seed,
            base_dir=scenario.base_dir,
        )
        return sessions, 0.0
    if scenario.replay is not None:
        from fastroute.workload.mix import mixed_replay_sessions

        rp = scenario.replay
        sessions = mixed_replay_sessions(
            rp,
            duration_s=scenario.duration_s,
            sources=tuple(r.name for r in scenario.regions),
            seed=seed,
            base_dir=scenario.base_dir,
        )
        return sessions, 0.0
    w = scenario.workload
    spikes = tuple(
        Burst(
            start_s=f.start_s,
            duration_s=f.duration_s,
            rate_multiplier=f.factor,
            sources=f.regions,
        )
        for f in scenario.faults
        if f.kind == "spike"
    )
    if spikes:
        import msgspec

        w = msgspec.structs.replace(w, bursts=w.bursts + spikes)
    if scenario.trace is not None:
        from pathlib import Path

        tr = scenario.trace
        path = Path(tr.path)
        if not path.is_absolute() and scenario.base_dir:
            path = Path(scenario.base_dir) / path
        sessions = load_trace(
            path,
            limit=tr.limit,
            time_scale=tr.time_scale,
            sources=tr.sources or tuple(r.name for r in scenario.regions),
            model=tr.model,
        )
        return [s for s in sessions if s.start_s < scenario.duration_s], 0.0
    return generate_sessions(w, duration_s=scenario.duration_s, seed=seed), w.rate_sessions_per_s


class Simulator:
    """Build the fleet of a scenario and run it.

    Parameters
    ----------
    scenario : Scenario
    policy : str, optional
        Policy of every data plane (default ``scenario.dataplane.policy``).
    seed : int, optional
        Default ``scenario.seed``.
    optimiser : Optimiser, optional
        The control plane's optimiser (default: built from ``scenario.control``).
    sessions : sequence of Session, optional
        Use these instead of the scenario's workload (tests).
    progress : callable, optional
        ``progress(virtual_s, horizon_s, events)`` called about twice a second of wall time.
    fast_forward : bool
        Apply runs of unobservable decode steps in closed form
        (:meth:`~fastroute.emulator.model.EngineModel.fast_forward`); off = step by step.
    """

    def __init__(
        self,
        scenario: Scenario,
        *,
        policy: str | None = None,
        seed: int | None = None,
        optimiser: Optimiser | None = None,
        sessions: Sequence[Session] | None = None,
        progress: Callable[[float, float, int], None] | None = None,
        fast_forward: bool = True,
    ) -> None:
        self.scenario = sc = scenario
        self.fast_forward = fast_forward
        self.seed = sc.seed if seed is None else seed
        self.policy_name = policy or sc.dataplane.policy
        self.progress = progress
        self.rng = random.Random(f"sim/{self.seed}")
        self.regions = [r.name for r in sc.regions]
        self._build_engines()
        if sessions is None:
            sessions, rate = prepare_sessions(sc, self.seed)
            if sc.target_load is not None and sc.trace is None and sessions:
                if sc.family is not None:
                    sessions = self._scale_family(sessions)
                elif sc.replay is not None:
                    sessions = self._scale_replay(sessions)
                else:
                    sessions = self._scale_to_load(sessions, rate)
        self.sessions = list(sessions)
        self._calibrate()
        self._build_classes()
        if optimiser is None:
            from fastroute.sim.control import make_optimiser

            optimiser = make_optimiser(sc.control.optimiser, sc.control.params)
        self.optimiser = optimiser
        self._build_dataplanes()
        dpc = sc.dataplane
        self.hedges = HedgeDelays(dpc, sc.slo.ttft_s) if dpc.hedge else None

    # -- construction ------------------------------------------------------------------------
    def _build_engines(self) -> None:
        sc = self.scenario
        self.engines: list[SimEngine] = []
        self.nominal: dict[str, Any] = {}
        self.transfer_nominal: dict[str, tuple[float, float, float]] = {}
        for g in sc.engines:
            cfg = EngineConfig(
                max_num_seqs=g.max_num_seqs,
                max_num_batched_tokens=g.max_num_batched_tokens,
                num_blocks=g.num_blocks,
                max_waiting=g.max_waiting,
                enable_prefix_caching=g.enable_prefix_caching,
            )
            profile = true_profile(get_profile(g.profile), g.step_time_factors)
            type_name = (g.hardware or g.profile).lower()
            if type_name not in self.nominal:
                # What the policy starts from: the datasheet profile of the group's hardware
                # label, not the true one; a label naming no built-in profile starts from
                # the default type's, as the proxy's FleetCalibration.nominal does.
                datasheet = datasheet_profile(type_name)
                assert datasheet is not None  # the default type is a built-in
                self.nominal[type_name] = NominalStepTimes.from_profile(
                    datasheet, max_num_batched_tokens=g.max_num_batched_tokens
                )
                self.transfer_nominal[type_name] = (
                    cfg.kv_transfer_latency_s,
                    float(datasheet.kv_bytes_per_token),
                    cfg.kv_transfer_bandwidth_Bps,
                )
            for i in range(g.count):
                name = f"{g.name}-{i}"
                idx = len(self.engines)
                self.engines.append(
                    SimEngine(
                        idx,
                        name,
                        make_engine_id(name),
                        g.name,
                        g.region or self.regions[0],
                        g.model,
                        g.role,
                        profile,
                        cfg,
                        seed=self.seed * 7919 + idx,
                        type_name=type_name,
                    )
                )
        self.engine_names = tuple(e.name for e in self.engines)
        #: Each disaggregated model's P/D protocol from its groups' kind (validated to agree).
        self.pd_protocols = {
            g.model: "bootstrap" if g.kind == "sglang" else "nixl"
            for g in sc.engines
            if g.role != "mixed"
        }
        n_r = len(self.regions)
        lat = np.full((n_r, n_r), sc.network.inter_region_ms / 1000.0)
        np.fill_diagonal(lat, sc.network.intra_region_ms / 1000.0)
        ridx = {r: i for i, r in enumerate(self.regions)}
        for a, row in sc.network.latency_ms.items():
            for b, ms in row.items():
                if a not in ridx or b not in ridx:
                    raise ScenarioError(f"network.latency_ms names unknown region {a!r}/{b!r}")
                lat[ridx[a], ridx[b]] = ms / 1000.0
                if b not in sc.network.latency_ms or a not in sc.network.latency_ms.get(b, {}):
                    lat[ridx[b], ridx[a]] = ms / 1000.0
        self.region_index = ridx
        self.latency_s = lat
        # One-way latency data plane (region) -> engine, as an (n_regions, n_engines) table.
        self.dp_engine_lat = [
            [float(lat[r, ridx[e.region]]) for e in self.engines] for r in range(n_r)
        ]

    def _scale_to_load(self, sessions: list[Session], rate: float) -> list[Session]:
        import msgspec

        sc = self.scenario
        requests = sum(len(s.turns) for s in sessions)
        per_session = requests / len(sessions)
        self._calibrate(sessions)
        capacity = sum(e.capacity_rps for e in self.engines if e.role != "decode")
        new_rate = sc.target_load * capacity / per_session  # type: ignore[operator]
        w = msgspec.structs.replace(sc.workload, rate_sessions_per_s=new_rate)
        self.scenario = sc = msgspec.structs.replace(sc, workload=w, target_load=None)
        sessions, _ = prepare_sessions(sc, self.seed)
        return sessions

    def _scale_replay(self, sessions: list[Session]) -> list[Session]:
        """Replay at ``target_load`` × the fleet's capacity (one request per session)."""
        import msgspec

        sc = self.scenario
        self._calibrate(sessions)
        capacity = self._pool_capacity_rps()
        rp = msgspec.structs.replace(sc.replay, rate_rps=sc.target_load * capacity)  # type: ignore[operator]
        self.scenario = sc = msgspec.structs.replace(sc, replay=rp, target_load=None)
        sessions, _ = prepare_sessions(sc, self.seed)
        return sessions

    def _scale_family(self, sessions: list[Session]) -> list[Session]:
        """Offer ``target_load`` × the fleet's capacity (requests/s) of the family."""
        import msgspec

        sc = self.scenario
        self._calibrate(sessions)
        capacity = self._pool_capacity_rps()
        fam = msgspec.structs.replace(sc.family, rate_rps=sc.target_load * capacity)  # type: ignore[arg-type,operator]
        self.scenario = sc = msgspec.structs.replace(sc, family=fam, target_load=None)
        sessions, _ = prepare_sessions(sc, self.seed)
        return sessions

    def _pool_capacity_rps(self) -> float:
        """Requests/s the fleet serves at ρ = 1: mixed engines plus, per disaggregated
        model, the smaller of its prefill and decode pools."""
        total = 0.0
        for m in sorted({e.model_name for e in self.engines}):
            pool = [e for e in self.engines if e.model_name == m]
            mixed = sum(e.capacity_rps for e in pool if e.role == "mixed")
            pre = sum(e.capacity_rps for e in pool if e.role == "prefill")
            dec = sum(e.capacity_rps for e in pool if e.role == "decode")
            total += mixed + (min(pre, dec) if pre and dec else 0.0)
        return total

    def _calibrate(self, sessions: Sequence[Session] | None = None) -> None:
        """Nominal capacity and idle latencies per engine from the workload's shapes."""
        sessions = self.sessions if sessions is None else sessions
        shapes = request_shapes(sessions, 384, seed=self.seed)
        if not shapes:
            shapes = [(512, 128)]
        self.mean_prompt = float(np.mean([p for p, _ in shapes]))
        self.mean_output = float(np.mean([o for _, o in shapes]))
        by_group = {g.name: g for g in self.scenario.engines}
        key_shapes = tuple(shapes)
        for e in self.engines:
            override = by_group[e.group].capacity_rps
            if override is not None:
                e.capacity_rps = override
                continue
            key = (e.profile.name, e.config, e.role, hash(key_shapes))
            cap = _capacity_cache.get(key)
            if cap is None:
                if e.role == "decode":
                    # A decode engine's work is the decode of a request; prompt KV arrives.
                    cap = saturation_capacity_rps(e.profile, e.config, [(1, o) for _, o in shapes])
                elif e.role == "prefill":
                    cap = saturation_capacity_rps(e.profile, e.config, [(p, 1) for p, _ in shapes])
                else:
                    cap = saturation_capacity_rps(e.profile, e.config, shapes)
                _capacity_cache[key] = cap
            e.capacity_rps = cap
        self.idle = [
            idle_latencies(e.profile, self.mean_prompt, self.mean_prompt + self.mean_output / 2)
            for e in self.engines
        ]

    def _build_classes(self) -> None:
        """Class rows: one per (region, model), plus a decode row for disaggregated models."""
        models = sorted({e.model_name for e in self.engines})
        pd_models = {e.model_name for e in self.engines if e.role != "mixed"}
        labels, sources, cmodels, roles = [], [], [], []
        self.row_of: dict[tuple[str, str], int] = {}
        self.decode_row_of: dict[tuple[str, str], int] = {}
        for r in self.regions:
            for m in models:
                self.row_of[(r, m)] = len(labels)
                role = "prefill" if m in pd_models else "mixed"
                labels.append(f"{r}/{m}")
                sources.append(r)
                cmodels.append(m)
                roles.append(role)
                if m in pd_models:
                    self.decode_row_of[(r, m)] = len(labels)
                    labels.append(f"{r}/{m}/decode")
                    sources.append(r)
                    cmodels.append(m)
                    roles.append("decode")
        self.class_labels = tuple(labels)
        self.class_sources = tuple(sources)
        self.class_models = tuple(cmodels)
        self.class_roles = tuple(roles)
        n_c, n_e = len(labels), len(self.engines)
        elig = np.zeros((n_c, n_e), dtype=bool)
        for g in range(n_c):
            for e in self.engines:
                elig[g, e.index] = e.model_name == cmodels[g] and (
                    e.role == roles[g] or (e.role == "mixed" and roles[g] == "mixed")
                )
        self.eligible = elig
        self.capacity = np.array([e.capacity_rps for e in self.engines])
        rtt = 2 * np.array([self.dp_engine_lat[self.region_index[s]] for s in sources])
        self.class_rtt = rtt
        for s in self.sessions:
            if (s.source, s.model) not in self.row_of:
                raise ScenarioError(
                    f"session {s.session_id}: no engine serves model {s.model!r} "
                    f"(source {s.source!r})"
                )

    def _build_dataplanes(self) -> None:
        w0 = self.eligible * self.capacity[None, :]
        s = w0.sum(axis=1, keepdims=True)
        self.weights = np.divide(w0, s, out=np.zeros_like(w0), where=s > 0)
        self.shed = np.zeros(len(self.class_labels))
        models = sorted({e.model_name for e in self.engines})
        pool = [models.index(e.model_name) for e in self.engines]
        ids = [e.engine_id for e in self.engines]
        self.type_names = tuple(sorted(self.nominal))
        types = [self.type_names.index(e.type_name) for e in self.engines]
        # Per region: `proxies` proxies, each with `workers` policy instances sharing
        # the proxy's in-flight counts (its shared-memory stats block).
        cfg = self.scenario.dataplane
        self.dataplanes: list[DataPlane] = []
        self.proxy_loads: list[tuple[str, ProxyLoads]] = []
        self.proxies_by_region: dict[str, list[list[DataPlane]]] = {}
        n_e = len(self.engines)
        exchange = (
            cfg.peer_key_exchange
            and cfg.peer_poll_interval_s > 0
            and cfg.proxies * len(self.regions) > 1
        )
        for r in self.regions:
            proxies = self.proxies_by_region[r] = []
            for _ in range(cfg.proxies):
                shared = ProxyLoads(
                    n_e,
                    peers=cfg.peer_poll_interval_s > 0,
                    key_log_entries=cfg.key_log_entries if cfg.workers > 1 or exchange else 0,
                    key_exchange=exchange,
                )
                self.proxy_loads.append((r, shared))
                workers = []
                for _ in range(cfg.workers):
                    i = len(self.dataplanes)
                    dp = DataPlane(
                        i,
                        r,
                        self.policy_name,
                        cfg,
                        ids,
                        self.weights,
                        pool,
                        type_names=self.type_names,
                        engine_types=types,
                        policy_extra=self._policy_extra(i),
                        shared_loads=shared,
                        capacity_rps=self.capacity,
                    )
                    workers.append(dp)
                    self.dataplanes.append(dp)
                proxies.append(workers)
        self.worker_rng = random.Random(f"workers/{self.seed}")
        for dp in self.dataplanes:
            dp.table_version = 0

    def _policy_extra(self, dp_index: int) -> dict[str, Any]:
        """Constructor arguments the simulator supplies to ``marginal-cost`` (as the proxy
        does, :mod:`fastroute.proxy.path.marginal_setup`): a calibration starting from the
        engines' *datasheet* constants (not their true ones), and a seeded sampler."""
        if self.policy_name != "marginal-cost":
            return {}
        from fastroute.predict.calibration import FleetCalibration, KVTransferModel

        params = self.scenario.dataplane.policy_params
        calibrate = bool(params.get("calibrate", True))
        first = self.type_names[0]
        latency, per_token, bandwidth = self.transfer_nominal[first]
        extra: dict[str, Any] = {
            "calibration": FleetCalibration(
                self.nominal,
                default_type=first,
                calibrate=calibrate,
                transfer=KVTransferModel(latency, per_token, bandwidth, calibrate=calibrate),
            ),
            "engine_type": first,
        }
        if "seed" not in params and "rng" not in params:
            extra["seed"] = self.seed * 104729 + dp_index
        return extra

    # -- event plumbing ------------------------------------------------------------------------
    def _push(self, t: float, kind: int, a: Any = None, b: Any = None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, a, b))

    def _touch(self, e: SimEngine, now: float) -> None:
        """Bring ``e`` to ``now`` before something changes it; the caller then :meth:`_kick`s.

        Applies the part of a pending decode jump that starts before ``now`` and voids
        its step event (the next step is rescheduled from the engine's new state).
        """
        if e.lazy_from is not None:
            self._steps_synced += e.sync(now)
            e.step_at = None
            e.step_token += 1

    def _kick(self, e: SimEngine, now: float) -> None:
        """Make sure ``e`` has a step event if it has work."""
        nxt = e.model.next_step_time(now)
        if nxt is None:
            return
        if e.lazy_from is None and (e.step_at is None or nxt < e.step_at):
            e.step_at = nxt
            e.step_token += 1
            self._push(nxt, K_STEP, e, e.step_token)

    # -- run -----------------------------------------------------------------------------------
    def run(self) -> SimResult:
        """Simulate until every session is done or ``duration_s + drain_s``."""
        sc = self.scenario
        wall0 = time.perf_counter()
        self._heap: list[tuple[float, int, int, Any, Any]] = []
        self._seq = 0
        self.records: list[RequestRecord] = []
        self.control: list[ControlSample] = []
        self._live: dict[str, _Req] = {}
        self._partitions: list[frozenset[str]] = []
        self._controller_down = 0
        self._steps_synced = 0
        self._table_version = 0
        n_e, n_c = len(self.engines), len(self.class_labels)
        self._window = EngineWindow.empty(n_e)
        self._arrivals = np.zeros(n_c)
        self._windows: deque[tuple[EngineWindow, np.ndarray]] = deque()
        for s in self.sessions:
            self._push(s.start_s, K_TURN, _Session(s, self._pick_dataplane(s.source)), 0)
        for f in sc.faults:
            if f.kind != "spike":
                self._push(f.start_s, K_FAULT, f, True)
                self._push(f.start_s + f.duration_s, K_FAULT, f, False)
        if sc.control.optimiser != "none":
            self._push(sc.control.period_s, K_CONTROL)
        poll_s = sc.dataplane.peer_poll_interval_s
        if poll_s > 0:
            phases = random.Random(f"peer-polls/{self.seed}")
            for _, proxy in self.proxy_loads:
                self._push(phases.uniform(0.0, poll_s), K_POLL, proxy)
        end = sc.duration_s + sc.drain_s
        self.end_s = end
        heap = self._heap
        pop = heapq.heappop
        events = heap_events = steps = 0
        next_progress = wall0 + 0.5
        now = 0.0
        while heap:
            t, kind, _, a, b = pop(heap)
            if t > end:
                heapq.heappush(heap, (t, kind, 0, a, b))
                break
            now = t
            heap_events += 1
            if kind == K_STEP:
                if b != a.step_token or not a.up:
                    continue
                n = self._run_steps(a, t)
                steps += n
                events += n
            else:
                events += 1
                if kind == K_RESPONSE:
                    self._on_response(t, a, b)
                elif kind == K_ARRIVE:
                    self._on_arrive(t, a)
                elif kind == K_TURN:
                    self._on_turn(t, a, b)
                elif kind == K_TRANSFER:
                    self._on_transfer(t, a)
                elif kind == K_PULL:
                    a.set_table(*b)
                elif kind == K_CONTROL:
                    self._on_control(t)
                elif kind == K_FAULT:
                    self._on_fault(t, a, b)
                elif kind == K_HEDGE:
                    self._on_hedge(t, a, b)
                elif kind == K_POLL:
                    self._on_poll(t, a)
            if self.progress is not None and not heap_events & 1023:
                w = time.perf_counter()
                if w >= next_progress:
                    next_progress = w + 0.5
                    self.progress(now, end, events)
        horizon = min(now, end) if heap else now
        for e in self.engines:
            self._steps_synced += e.sync(horizon)
        steps += self._steps_synced
        events += self._steps_synced
        for req in list(self._live.values()):
            self._finish(req, horizon, "failed", "unfinished")
        wall = time.perf_counter() - wall0
        if self.progress is not None:
            self.progress(horizon, end, events)
        return SimResult(
            records=sorted(self.records, key=lambda r: (r.arrival_s, r.request_id)),
            control=self.control,
            engines=self._engine_stats(horizon),
            class_labels=self.class_labels,
            engine_names=self.engine_names,
            horizon_s=horizon,
            events=events,
            heap_events=heap_events,
            steps=steps,
            wall_s=wall,
        )

    def _engine_stats(self, horizon: float) -> list[dict[str, Any]]:
        out = []
        for e in self.engines:
            hit, queried = e.cache_hit_tokens
            out.append(
                {
                    "name": e.name,
                    "region": e.region,
                    "model": e.model_name,
                    "role": e.role,
                    "capacity_rps": e.capacity_rps,
                    "utilisation": e.busy_s / horizon if horizon > 0 else 0.0,
                    "steps": e.steps,
                    "preemptions": e.preemptions_total,
                    "prefix_hit_rate": hit / queried if queried else None,
                }
            )
        return out

    # -- engines -------------------------------------------------------------------------------
    def _run_steps(self, e: SimEngine, t: float) -> int:
        """Run ``e``'s steps from ``t`` while no other event is due first.

        Steps that nobody can observe (decodes that emit neither a first nor a last
        token) are not run one by one: the engine jumps to the next observable step
        with one event (:meth:`EngineModel.fast_forward`); anything that touches the
        engine earlier applies the part of the jump before it first (:meth:`SimEngine.sync`).
        """
        e.step_at = None
        model = e.model
        heap = self._heap
        end = self.end_s
        n = 0
        if e.lazy_from is not None:
            k = e.sync(t)
            if not k:
                raise RuntimeError(f"{e.name}: fast-forward could not be applied at t={t}")
            n += k
            e.steps -= k  # counted below with the rest
        ff = self.fast_forward
        while True:
            if ff:
                k, t_vis, _ = model.fast_forward(t, dry_run=True)
                if k:
                    e.lazy_from = t
                    e.step_at = t_vis
                    e.step_token += 1
                    self._seq += 1
                    heapq.heappush(heap, (t_vis, K_STEP, self._seq, e, e.step_token))
                    break
            res = model.step(t)
            n += 1
            e.busy_s += res.duration_s
            if res.emitted:
                self._on_emitted(e, res)
            nxt = model.next_step_time(res.end_s)
            if nxt is None:
                break
            if res.duration_s == 0.0 and nxt <= t:
                nxt = t + 1e-4  # nothing could be scheduled: do not spin
            if nxt > end or (heap and heap[0][0] <= nxt):
                e.step_at = nxt
                e.step_token += 1
                self._seq += 1
                heapq.heappush(heap, (nxt, K_STEP, self._seq, e, e.step_token))
                break
            t = nxt
        e.steps += n
        return n

    def _on_emitted(self, e: SimEngine, res: Any) -> None:
        end = res.end_s
        back = None
        for mreq in res.emitted:
            if mreq.num_output != 1:
                continue
            att = mreq.data
            if att.fail_first:
                att.failed = True
                if not mreq.finished:
                    e.model.cancel(mreq.request_id)
                e.live.pop(mreq.request_id, None)
                if back is None:
                    back = self.dp_engine_lat[self.region_index[att.req.sess.dp.region]][e.index]
                self._push(end + back, K_RESPONSE, att, Outcome.HTTP_5XX)
            elif att.phase == "mixed" or att.phase == "decode":
                att.first_token_s = end
                self._prefilled(att)
                if att.req.legs is not None:  # a race: decided when the token lands
                    self._push(end, K_HEDGE, att, True)
                mix = att.req.sess.dp.interleave
                if mix is not None:  # as the proxy's AttemptLoad.first_token
                    if att.phase == "mixed":
                        mix.prefilled(e.index, att.req.prompt.num_tokens)
                    att.mix_mark = mix.mark(e.index)
        for mreq in res.finished:
            att = mreq.data
            if att.failed:
                continue
            e.live.pop(mreq.request_id, None)
            if att.phase == "prefill":
                att.prefill_end_s = end
                att.prefill_cached = mreq.num_cached_tokens
                self._push(self._kv_arrives_s(att, e, end), K_TRANSFER, att)
                continue
            back = self.dp_engine_lat[self.region_index[att.req.sess.dp.region]][e.index]
            self._push(end + back, K_RESPONSE, att, Outcome.SUCCESS)

    def _kv_arrives_s(self, att: _Attempt, p: SimEngine, end: float) -> float:
        """When the decode engine of a P/D attempt starts on the KV its prefill (on ``p``,
        done at ``end``) computed: the P->D hop after whatever the protocol waits for.

        vLLM's protocol (sequential) first sends the prefill's answer back to the data
        plane, which then sends the decode request; SGLang's (concurrent) sent the decode
        request with the prefill's, so only its arrival can be later than the KV.
        """
        d = self.engines[att.decode_engine]
        hop = float(self.latency_s[self.region_index[p.region], self.region_index[d.region]])
        to_engine = self.dp_engine_lat[self.region_index[att.req.sess.dp.region]]
        if self.pd_protocols.get(p.model_name) == "bootstrap":
            return max(end + hop, att.sent_s + to_engine[d.index])
        return end + to_engine[p.index] + to_engine[d.index] + hop

    def _submit(self, e: SimEngine, att: _Attempt, t: float, **kw: Any) -> Outcome | None:
        self._touch(e, t)
        req = att.req
        mreq = Request(
            f"{req.rid}#{att.n}{'d' if kw.get('remote_prefill') else ''}",
            req.prompt.num_tokens,
            req.prompt.block_hashes,
            data=att,
            **kw,
        )
        try:
            e.model.submit(mreq, t)
        except QueueFullError:
            return Outcome.RATE_LIMITED
        except RequestTooLongError:
            return Outcome.CLIENT_ERROR
        att.mreq = mreq
        att.generation = e.generation
        e.live[mreq.request_id] = att
        self._kick(e, t)
        return None

    def _on_arrive(self, t: float, att: _Attempt) -> None:
        if att.cancelled:
            return  # a hedged race's loser, cancelled on its way
        e = self.engines[att.engine]
        dp = att.req.sess.dp
        back = self.dp_engine_lat[self.region_index[dp.region]][e.index]
        if not e.up:
            self._push(t + back, K_RESPONSE, att, Outcome.CONNECT_ERROR)
            return
        att.fail_first = e.error_rate > 0 and self.rng.random() < e.error_rate
        if att.decode_engine >= 0:
            att.phase = "prefill"
            fail = self._submit(e, att, t, output_tokens=1, hold_kv=True)
        else:
            att.phase = "mixed"
            fail = self._submit(e, att, t, output_tokens=att.req.max_tokens)
        if fail is not None:
            self._push(t + back, K_RESPONSE, att, fail)

    def _on_transfer(self, t: float, att: _Attempt) -> None:
        """P/D: the prefill finished; hand its KV to the decode engine."""
        p = self.engines[att.engine]
        d = self.engines[att.decode_engine]
        dp = att.req.sess.dp
        back = self.dp_engine_lat[self.region_index[dp.region]][d.index]
        if p.up and p.generation == att.generation:
            self._touch(p, t)
            try:
                p.model.claim_transfer(att.mreq.request_id, t)
            except KeyError:
                pass  # expired: the decode side recomputes nothing here, the KV still "arrives"
            self._kick(p, t)
        # The prefill request's answer reaches the data plane: the prefill engine's part
        # of the attempt is over (its in-flight count, policy hook and calibration).
        self._release_prefill(att, True)
        if not d.up or self._cut(p.region, d.region):
            self._push(t + back, K_RESPONSE, att, Outcome.CONNECT_ERROR)
            return
        att.phase = "decode"
        self._touch(d, t)
        if dp.calibration is not None:
            q_tok, _, b, ctx, _ = engine_load(d.model)
            att.dload0 = (int(b), int(ctx), int(q_tok))
        dp.routed(att.decode_route, d.index, att.req.prompt.num_tokens + att.req.max_tokens)
        att.d_open = True
        fail = self._submit(d, att, t, output_tokens=att.req.max_tokens, remote_prefill=True)
        if fail is not None:
            self._kick(d, t)
            self._push(t + back, K_RESPONSE, att, fail)

    @staticmethod
    def _prefilled(att: _Attempt) -> None:
        """The attempt's prompt is no longer queued on its first engine (its first
        token, its prefill's answer, or its end)."""
        if att.queued:
            att.req.sess.dp.prefilled(att.engine, att.queued)
            att.queued = 0

    def _release_prefill(self, att: _Attempt, ok: bool) -> None:
        """The attempt's first engine (prefill, or the whole request) is done with it."""
        self._prefilled(att)
        if not att.p_open:
            return
        att.p_open = False
        req = att.req
        dp = req.sess.dp
        e = self.engines[att.engine]
        dp.completed(req.route, e.index, req.prompt.num_tokens + req.max_tokens, ok)
        if ok and att.decode_engine >= 0 and dp.calibration is not None and att.load0:
            # A P/D prefill answers one token as JSON: the proxy calibrates the prefill
            # model with the whole attempt (forward -> answer), network included.
            back = self.dp_engine_lat[self.region_index[dp.region]][e.index]
            # float(): event times may be numpy scalars (latency matrix), and the
            # calibration state must stay plain floats (it is exported as JSON).
            took = float(att.prefill_end_s + back - att.sent_s)
            n = req.prompt.num_tokens
            c = min(max(0, att.prefill_cached), n - 1)
            b0, s0, q0 = att.load0
            dp.interleave.prefilled(e.index, n)  # as the proxy's release of a JSON answer
            dp.interleave.observe_cached(e.index, n, c)
            if took > 0:
                dp.calibration.observe_prefill(
                    e.type_name, e.engine_id, n - c, c, took,
                    batch=b0, context=s0, queued_tokens=q0,
                )  # fmt: skip

    def _release_decode(self, att: _Attempt, ok: bool) -> None:
        """The P/D attempt's decode engine is done with it."""
        if not att.d_open:
            return
        att.d_open = False
        req = att.req
        dp = req.sess.dp
        tokens = req.prompt.num_tokens + req.max_tokens
        dp.completed(att.decode_route, att.decode_engine, tokens, ok)

    def _calibrate_from(self, att: _Attempt, t: float, first_dp_s: float) -> None:
        """Feed a served request's timings to the policy, as the proxy does
        (fastroute.proxy.path.engine_load): TTFT over the prompt's uncached tokens and the load
        met on arrival, mean TBOT at the batch it ran beside, and the output length. All
        times are the data plane's: forward -> first chunk -> last chunk."""
        req = att.req
        dp = req.sess.dp
        cal = dp.calibration
        n, out = req.prompt.num_tokens, req.max_tokens
        if att.decode_engine < 0:
            e = self.engines[att.engine]
            load = att.load0
            if load is not None:
                b0, s0, q0 = load
                mreq = att.mreq
                c = min(max(0, mreq.num_cached_tokens if mreq is not None else 0), n - 1)
                dp.interleave.observe_cached(e.index, n, c)
                ttft = float(first_dp_s - att.sent_s)
                if ttft > 0:
                    cal.observe_prefill(
                        e.type_name, e.engine_id, n - c, c, ttft,
                        batch=b0, context=s0, queued_tokens=q0,
                    )  # fmt: skip
        else:
            e = self.engines[att.decode_engine]
            load = att.dload0
        if load is not None and out > 1 and t > first_dp_s:
            b0, s0, _ = load
            tbot = float(t - first_dp_s) / (out - 1)
            mix = dp.interleave.per_step(e.index, att.mix_mark, out - 1)
            dp.state.values[e.index, _MIX] = dp.interleave.expected[e.index]
            cal.observe_decode(
                e.type_name, e.engine_id, b0 + 1, int(s0 + n + out / 2), tbot,
                prefill_tokens_per_step=mix,
            )  # fmt: skip
        dp.policy.observe_output(req.route, out, t)

    # -- data planes ---------------------------------------------------------------------------
    def _cut(self, region_a: str, region_b: str) -> bool:
        if region_a == region_b:
            return False
        return any(region_a in p and region_b in p for p in self._partitions)

    def _pick_dataplane(self, region: str) -> DataPlane:
        """The worker a request lands on: a uniformly random proxy of its region, then a
        uniformly random worker of it (``SO_REUSEPORT``); one seeded stream."""
        proxies = self.proxies_by_region[region]
        rng = self.worker_rng
        workers = proxies[rng.randrange(len(proxies))] if len(proxies) > 1 else proxies[0]
        return workers[rng.randrange(len(workers))] if len(workers) > 1 else workers[0]

    def _on_turn(self, t: float, sess: _Session, turn: int) -> None:
        s = sess.session
        if turn:
            # Each request picks its worker anew. Safe to rebind the session's: a turn
            # starts only after the previous one was served, when none of its attempts
            # is open any more.
            sess.dp = self._pick_dataplane(s.source)
        dp = sess.dp
        req = _Req()
        req.rid = f"{s.session_id}/{turn}"
        req.sess = sess
        req.turn = turn
        req.row = self.row_of[(s.source, s.model)]
        req.decode_row = self.decode_row_of.get((s.source, s.model), -1)
        req.prompt = sess.prompts.prompt(turn)
        spec = s.turns[turn]
        req.max_tokens = spec.max_tokens
        policy = dp.policy
        prefix = self._prefix(sess, turn, policy.prefix_bytes) if policy.needs_prefix else b""
        route_key, key_depth = self._route_key(sess, turn)
        if dp.calibration is not None:
            # The tenant keys the output-length histograms (a proxy gets it from a header).
            req.route = MarginalRequest(
                key_hash=route_key,
                row=req.row,
                prompt_tokens=req.prompt.num_tokens,
                prefix=prefix,
                tenant=s.tenant,
            )
        else:
            req.route = RouteRequest(
                key_hash=route_key,
                row=req.row,
                prompt_tokens=req.prompt.num_tokens,
                prefix=prefix,
                expected_output_tokens=spec.max_tokens,
                key_depth_bytes=key_depth if prefix else -1,
            )
        req.arrival_s = t
        req.attempts = 0
        req.tried = ()
        req.decision = None
        req.decode_ranked = ()
        req.ticket = -1
        req.holds_slot = False
        req.done = False
        req.sent_tokens = 0  # output tokens earlier (migrated) segments delivered
        req.first_token_at = None  # the client's first token, from the first segment
        req.legs = None  # the live attempts of a hedged race
        req.record = RequestRecord(
            request_id=req.rid,
            session_id=s.session_id,
            turn=turn,
            cls=self.class_labels[req.row],
            source=s.source,
            model=s.model,
            tenant=s.tenant,
            arrival_s=t,
            prompt_tokens=req.prompt.num_tokens,
            attempts=0,
        )
        self._live[req.rid] = req
        self._arrivals[req.row] += 1
        if dp.config.shedding and should_shed(req.route.key_hash, float(dp.shed_fraction[req.row])):
            self._finish(req, t, "shed", "shed-fraction")
            return
        guard = dp.guard
        if guard is not None:
            for ticket in guard.tick(t):
                waiter = dp.waiting.pop(ticket, None)
                if waiter is not None:
                    self._finish(waiter, t, "shed", "queue-timeout")
            adm = guard.arrive(t)
            if adm.verdict is Verdict.GRANTED:
                req.holds_slot = True
            elif adm.verdict is Verdict.QUEUED:
                req.ticket = adm.ticket
                dp.waiting[adm.ticket] = req
                return
            else:
                self._finish(req, t, "shed", "queue-delay")
                return
        dp.budget.deposit(t)
        self._dispatch(t, req)

    @staticmethod
    def _prefix(sess: _Session, turn: int, limit_bytes: int) -> bytes:
        s = sess.session
        parts = [s.system_prompt] if s.system_prompt else []
        size = len(parts[0]) if parts else 0
        for i in range(turn + 1):
            if size >= limit_bytes:
                break
            parts.append(s.turns[i].user_text)
            size += len(parts[-1])
            if i < turn and size < limit_bytes:
                parts.append(reply_text(s.session_id, i, s.turns[i].max_tokens))
                size += len(parts[-1])
        return "\n".join(parts).encode()[:limit_bytes]

    def _route_key(self, sess: _Session, turn: int) -> tuple[int, int]:
        """The request's routing key and the depth it ends at (-1: not a prefix), as
        ``dataplane.routing_key`` says the proxy derives it."""
        s = sess.session
        how = self.scenario.dataplane.routing_key
        if how == "completion":
            return key_hash(self._prefix(sess, turn, PROMPT_KEY_PREFIX_BYTES)), -1
        if how == "conversation":
            first = s.turns[0].user_text
            return key_hash(f"{s.system_prompt}\n{first}" if s.system_prompt else first), (
                self._key_depth(sess)
            )
        return key_hash(s.session_id), self._key_depth(sess)

    @staticmethod
    def _key_depth(sess: _Session) -> int:
        """Where the proxy's conversation key ends in :meth:`_prefix`'s bytes: the system
        prompt and the first user message, joined by a newline."""
        s = sess.session
        first = len(s.turns[0].user_text.encode())
        return len(s.system_prompt.encode()) + 1 + first if s.system_prompt else first

    def _fill_state(self, dp: DataPlane, t: float, req: _Req) -> None:
        """Bring ``dp``'s :class:`EngineState` (and exact prefix hits) up to ``t``.

        Read from the engine models' scheduler state (:func:`fastroute.sim.fleet.engine_load`):
        counts and KV usage as vLLM exports them, token sums as the proxy's bookkeeping
        estimates them, here exact and fresh (an upper bound on a data plane's knowledge).
        """
        v = dp.state.values
        lat = self.dp_engine_lat[self.region_index[dp.region]]
        hashes = req.prompt.block_hashes
        max_blocks = (req.prompt.num_tokens - 1) // 16
        hits = np.zeros(len(self.engines)) if dp.policy.needs_prefix else None
        touched = []
        for e in self.engines:
            if e.lazy_from is not None:
                self._touch(e, t)
                touched.append(e)
            row = v[e.index]
            if e.up:
                m = e.model
                row[_Q_TOK], row[_Q_REQ], row[_B], row[_S], row[_KV_USED] = engine_load(m)
                row[_KV_CAP] = m.kv.num_blocks * 16
                if hits is not None and e.config.enable_prefix_caching and hashes:
                    hits[e.index] = m.kv.lookup(hashes, max_blocks)[0] * 16
            else:
                row[_Q_TOK] = row[_Q_REQ] = row[_B] = row[_S] = row[_KV_USED] = 0.0
            row[_NET] = lat[e.index]
        for e in touched:
            self._kick(e, t)
        dp.view.prefix_hits = hits

    def _dispatch(self, t: float, req: _Req) -> None:
        dp = req.sess.dp
        dp.refresh_mask(t)
        if dp.needs_state:
            self._fill_state(dp, t, req)
        k = dp.config.k
        engine = -1
        decode = -1
        if req.decision is not None:
            for i in req.decision.ranked:
                if i not in req.tried:
                    engine = i
                    break
        if engine < 0 and req.decode_row >= 0 and dp.pairs is not None:
            decode_route = msgspec.structs.replace(req.route, row=req.decode_row)
            p_dec, d_dec = dp.pairs.choose_pair(req.route, decode_route, dp.view, dp.view, k)
            if p_dec.reason == REASON_SLO_INFEASIBLE:
                self._finish(req, t, "shed", REASON_SLO_INFEASIBLE)
                return
            req.decision = p_dec
            req.decode_ranked = d_dec.ranked
            ranked = p_dec.ranked
            for i in ranked:
                if i not in req.tried:
                    engine = i
                    break
            else:
                engine = ranked[0] if ranked else -1
        elif engine < 0:
            req.decision = dp.policy.choose(req.route, dp.view, k)
            if req.decision.reason == REASON_SLO_INFEASIBLE:
                self._finish(req, t, "shed", REASON_SLO_INFEASIBLE)
                return
            ranked = req.decision.ranked
            for i in ranked:
                if i not in req.tried:
                    engine = i
                    break
            else:
                engine = ranked[0] if ranked else -1
        if engine < 0:
            self._finish(req, t, "failed", "no-engine")
            return
        droute = None
        if req.decode_row >= 0:
            droute = RouteRequest(
                key_hash=req.route.key_hash, row=req.decode_row, prompt_tokens=req.prompt.num_tokens
            )
            if req.decode_ranked:
                # The pair's decode ranking; a retry moves down it.
                decode = req.decode_ranked[req.attempts % len(req.decode_ranked)]
            else:
                dd = dp.policy.choose(droute, dp.view, 1)
                if not dd.ranked:
                    self._finish(req, t, "failed", "no-engine")
                    return
                decode = dd.ranked[0]
        att = _Attempt()
        att.req = req
        att.n = req.attempts
        att.engine = engine
        att.decode_engine = decode
        att.sent_s = t
        att.fail_first = False
        att.mreq = None
        att.first_token_s = None
        att.mix_mark = 0.0
        att.phase = ""
        att.failed = False
        att.generation = -1
        att.p_open = True
        att.d_open = False
        att.dload0 = None
        att.prefill_end_s = -1.0
        att.prefill_cached = 0
        att.decode_route = droute
        att.cancelled = False
        # Less the prefix the policy expects cached there (the proxy's count, forward.py).
        decision = req.decision
        att.queued = (
            req.prompt.num_tokens
            if decision is None
            else decision.queued_prefill_tokens(engine, req.prompt.num_tokens)
        )
        if req.legs is not None:
            req.legs.append(att)
        if att.n == 0 and self.hedges is not None and decode < 0:
            self._push(t + self.hedges.delay_s(id(dp), req.row), K_HEDGE, att)
        if dp.needs_state:
            row = dp.state.values[engine]
            att.load0 = (int(row[_B]), int(row[_S]), int(row[_Q_TOK]))
        else:
            att.load0 = None
        req.attempts += 1
        req.tried = (*req.tried, engine)
        e = self.engines[engine]
        dp.routed(req.route, engine, req.prompt.num_tokens + req.max_tokens, att.queued)
        if self._cut(dp.region, e.region):
            self._push(t + dp.config.connect_timeout_s, K_RESPONSE, att, Outcome.TIMEOUT)
            return
        self._push(t + self.dp_engine_lat[self.region_index[dp.region]][engine], K_ARRIVE, att)

    def _on_response(self, t: float, att: _Attempt, outcome: Outcome) -> None:
        if att.cancelled:
            return  # a hedged race's loser: released when it was cancelled
        req = att.req
        dp = req.sess.dp
        e = self.engines[att.engine]
        i = att.engine
        ok = outcome is Outcome.SUCCESS
        self._release_prefill(att, ok)
        self._release_decode(att, ok)
        if dp.outlier is not None:
            dp.outlier.record(i, outcome, t)
        w = self._window
        w.attempts[i] += 1
        if outcome in _ENGINE_FAULTS:
            w.errors[i] += 1
        if req.done:
            return  # finished meanwhile (e.g. counted unfinished); nothing more to do
        if not ok and req.legs is not None and self._hedge_leg_failed(att):
            return  # the race's other attempt is still on
        if ok:
            j = att.decode_engine if att.decode_engine >= 0 else i
            # Client-side first token: the engine's emission plus the way back.
            first = att.first_token_s if att.first_token_s is not None else t
            back_j = self.dp_engine_lat[self.region_index[dp.region]][j]
            ttft = first + back_j - req.arrival_s
            out = req.max_tokens + req.sent_tokens
            if req.first_token_at is not None:  # migrated: the first segment's first token
                ttft = req.first_token_at - req.arrival_s
            else:
                w.ttft_count[i] += 1
                w.ttft_sum_s[i] += ttft
            w.e2e_count[j] += 1
            w.e2e_sum_s[j] += t - req.arrival_s
            if out > 1:
                w.tbot_count[j] += 1
                w.tbot_sum_s[j] += (t - req.arrival_s - ttft) / (out - 1)
            rec = req.record
            rec.first_token_s = req.arrival_s + ttft
            if self.hedges is not None:
                self.hedges.observe(id(dp), req.row, ttft)
            rec.output_tokens = out
            if dp.calibration is not None:
                self._calibrate_from(att, t, first + back_j)
                tbot = (t - req.arrival_s - ttft) / (out - 1) if out > 1 else None
                dp.policy.observe_outcome(req.route, ttft, tbot)  # the reject bound's input
            mreq = att.mreq
            if mreq is not None:
                rec.cached_tokens = mreq.num_cached_tokens if att.decode_engine < 0 else -1
                rec.preemptions = mreq.num_preemptions
            self._finish(req, t, "ok", "", engine=self.engines[j].name)
            sess = req.sess
            s = sess.session
            sess.prompts.add_reply(req.turn, reply_text(s.session_id, req.turn, out))
            if req.turn + 1 < len(s.turns):
                self._push(t + s.turns[req.turn + 1].think_s, K_TURN, sess, req.turn + 1)
            return
        if self._migrate(t, att, outcome):
            return
        retry = False
        if outcome is not Outcome.CLIENT_ERROR:
            cfg = dp.config
            if cfg.retry == "fixed":
                retry = req.attempts < cfg.max_attempts
            elif cfg.retry == "budget":
                retry = dp.budget.may_retry(req.attempts - 1, t)
        if retry:
            self._dispatch(t, req)
            return
        self._finish(req, t, "failed", _FAILURE_REASON.get(outcome, "error"), engine=e.name)

    def _on_hedge(self, t: float, att: _Attempt, token: bool | None) -> None:
        """``token``: an attempt of a hedged race emitted its first token at ``t`` (the
        first to land wins). Else the hedge delay of the request's first attempt passed:
        unless its first token came (or it failed, or was retried), send the request to
        the runner-up too, as the proxy does (:mod:`fastroute.sim.hedging`).

        Engines compute a step's tokens when the step starts, so a first token may be
        known before it lands: races are decided at the landing time (this event)."""
        req = att.req
        if token:
            if req.legs is not None and not att.cancelled:
                self._hedge_won(att, t)
            return
        dp = req.sess.dp
        landing = att.first_token_s
        if req.done or req.attempts != 1 or att.failed or (landing is not None and landing <= t):
            return
        ranked = req.decision.ranked if req.decision is not None else ()
        if not any(i not in req.tried for i in ranked):
            return  # no runner-up
        if dp.config.shedding and float(dp.shed_fraction[req.row]) > 0.0:
            return
        if dp.config.retry == "none" or not dp.budget.try_withdraw(t):
            return
        req.legs = [att]
        req.record.hedged = True
        self._dispatch(t, req)  # the first untried engine of the ranking: the runner-up
        if req.legs is not None and len(req.legs) < 2:
            req.legs = None
        elif landing is not None:  # its token is computed and lands later: the race is on
            self._push(landing, K_HEDGE, att, True)

    def _hedge_won(self, att: _Attempt, t: float) -> None:
        """``att`` emitted the race's first token at ``t``: cancel the other attempt on
        its engine (what it prefilled until now is the hedge's cost)."""
        req = att.req
        legs, req.legs = req.legs, None
        assert legs is not None
        rec = req.record
        rec.hedge_won = att.n != 0
        for other in legs:
            if other is att:
                continue
            other.cancelled = other.failed = True
            mreq = other.mreq
            e = self.engines[other.engine]
            if mreq is not None and mreq.request_id in e.live:
                self._touch(e, t)
                done = min(mreq.num_computed, mreq.num_prompt_tokens) - mreq.num_cached_tokens
                rec.hedge_prefill_tokens += max(0, done)
                e.model.cancel(mreq.request_id)
                e.live.pop(mreq.request_id, None)
                self._kick(e, t)
            self._release_prefill(other, False)

    def _hedge_leg_failed(self, att: _Attempt) -> bool:
        """An attempt of a hedged race failed before its first token: True when the
        race's other attempt goes on (no retry for this one)."""
        req = att.req
        legs = req.legs
        assert legs is not None
        others = [o for o in legs if o is not att and not o.cancelled]
        req.legs = None if len(others) < 2 else others
        return bool(others)

    def _migrate(self, t: float, att: _Attempt, outcome: Outcome) -> bool:
        """Continue a stream that broke after its first token on the next engine, as the
        proxy's mid-stream migration does (``dataplane.max_migrations``): the prompt plus
        the tokens generated so far (prefilled again; generated blocks are not cached),
        the rest of ``max_tokens``; one retry from the budget. Whether it was."""
        req = att.req
        dp = req.sess.dp
        cfg = dp.config
        mreq = att.mreq
        if (
            req.record.migrations >= cfg.max_migrations
            or outcome is Outcome.CLIENT_ERROR
            or att.phase != "mixed"
            or att.first_token_s is None
            or mreq is None
            or not 0 < mreq.num_output < req.max_tokens
            or cfg.retry == "none"
        ):
            return False
        if cfg.retry == "budget" and not dp.budget.try_withdraw(t):
            return False
        generated = mreq.num_output
        if req.first_token_at is None:
            back = self.dp_engine_lat[self.region_index[dp.region]][att.engine]
            req.first_token_at = att.first_token_s + back
        req.sent_tokens += generated
        req.max_tokens -= generated
        req.prompt = dataclasses.replace(req.prompt, num_tokens=req.prompt.num_tokens + generated)
        req.record.migrations += 1
        req.record.migrated_tokens += generated
        self._dispatch(t, req)
        return True

    def _finish(self, req: _Req, t: float, outcome: str, reason: str, engine: str = "") -> None:
        if req.done:
            return
        req.done = True
        self._live.pop(req.rid, None)
        rec = req.record
        rec.outcome = outcome  # type: ignore[assignment]
        rec.reason = reason
        rec.finish_s = t
        rec.attempts = req.attempts
        rec.engine = engine
        if req.arrival_s >= self.scenario.warmup_s:
            self.records.append(rec)
        dp = req.sess.dp
        if req.ticket >= 0 and dp.guard is not None and not req.holds_slot:
            dp.guard.cancel(req.ticket, t)
            dp.waiting.pop(req.ticket, None)
        if req.holds_slot and dp.guard is not None:
            req.holds_slot = False
            ticket = dp.guard.release(t)
            if ticket is not None:
                waiter = dp.waiting.pop(ticket, None)
                if waiter is not None:
                    waiter.holds_slot = True
                    waiter.ticket = -1
                    dp.budget.deposit(t)
                    self._dispatch(t, waiter)

    # -- control plane -------------------------------------------------------------------------
    def _on_control(self, t: float) -> None:
        sc = self.scenario
        period = sc.control.period_s
        w = self._window
        w.load_rps = w.attempts / period
        self._windows.append((w, self._arrivals / period))
        n_e, n_c = len(self.engines), len(self.class_labels)
        self._window = EngineWindow.empty(n_e)
        self._arrivals = np.zeros(n_c)
        lag = sc.control.lag_periods
        while len(self._windows) > lag + 1:
            self._windows.popleft()
        if t + period <= self.end_s:
            self._push(t + period, K_CONTROL)
        if self._controller_down or len(self._windows) <= lag:
            return
        window, demand = self._windows[0]
        inp = ControlInput(
            now_s=t,
            period_s=period,
            engine_names=self.engine_names,
            engine_regions=tuple(e.region for e in self.engines),
            engine_models=tuple(e.model_name for e in self.engines),
            class_labels=self.class_labels,
            class_sources=self.class_sources,
            class_models=self.class_models,
            class_roles=self.class_roles,
            demand_rps=demand,
            eligible=self.eligible,
            network_latency_s=self.class_rtt,
            capacity_rps=self.capacity,
            idle_ttft_s=np.array([i[0] for i in self.idle]),
            idle_tbot_s=np.array([i[1] for i in self.idle]),
            mean_output_tokens=self.mean_output,
            window=window,
            weights=self.weights,
            engine_tokens=np.array([e.token_counts for e in self.engines], dtype=np.float64).T,
        )
        w0 = time.perf_counter()
        out: ControlOutput = self.optimiser(inp)
        wall = time.perf_counter() - w0
        weights = np.asarray(out.weights, dtype=np.float64)
        if weights.shape != self.weights.shape:
            raise ValueError(
                f"optimiser returned weights {weights.shape}, expected {self.weights.shape}"
            )
        from fastroute.sim.metrics import weight_churn

        churn = weight_churn(self.weights, weights, np.maximum(demand, 1e-9))
        self.weights = weights
        self.shed = np.asarray(out.shed_fraction, dtype=np.float64)
        self._table_version += 1
        self.control.append(
            ControlSample(t, weights.copy(), self.shed.copy(), demand.copy(), churn, wall, out.info)
        )
        # One count per proxy: its workers share the arrays.
        loads = np.sum([p[0].loads for ps in self.proxies_by_region.values() for p in ps], axis=0)
        loads.flags.writeable = False
        for dp in self.dataplanes:
            delay = self.rng.uniform(0.0, sc.control.pull_jitter_s)
            self._push(t + delay, K_PULL, dp, (weights, self.shed, self._table_version, loads))

    # -- faults --------------------------------------------------------------------------------
    def _fault_engines(self, names: Sequence[str]) -> list[SimEngine]:
        wanted = set(names)
        return [e for e in self.engines if e.name in wanted or e.group in wanted]

    def _on_poll(self, t: float, proxy: ProxyLoads) -> None:
        """A proxy's poll of the other proxies (every proxy of the deployment: they
        share the engines across regions too; a partitioned peer answers nothing)."""
        region = next(r for r, p in self.proxy_loads if p is proxy)
        proxy.polled(
            [p for r, p in self.proxy_loads if p is not proxy and not self._cut(region, r)]
        )
        self._push(t + self.scenario.dataplane.peer_poll_interval_s, K_POLL, proxy)

    def _on_fault(self, t: float, f: Any, start: bool) -> None:
        if f.kind == "crash":
            for e in self._fault_engines(f.engines):
                if start and e.up:
                    self._touch(e, t)
                    e.up = False
                    back_by_dp = [row[e.index] for row in self.dp_engine_lat]
                    for att in list(e.live.values()):
                        if att.failed:
                            continue
                        att.failed = True
                        r = self.region_index[att.req.sess.dp.region]
                        self._push(t + back_by_dp[r], K_RESPONSE, att, Outcome.CONNECT_ERROR)
                    e.restart_model()
                elif not start:
                    e.up = True
        elif f.kind == "slowdown":
            for e in self._fault_engines(f.engines):
                self._touch(e, t)
                e.slowdown = f.factor if start else 1.0
                e.model.slowdown = e.slowdown
                self._kick(e, t)
        elif f.kind == "errors":
            for e in self._fault_engines(f.engines):
                e.error_rate = f.error_rate if start else 0.0
        elif f.kind == "partition":
            cut = frozenset(f.regions)
            if start:
                self._partitions.append(cut)
            elif cut in self._partitions:
                self._partitions.remove(cut)
        elif f.kind == "controller-outage":
            self._controller_down += 1 if start else -1
