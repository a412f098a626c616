"""Simulated engines and data planes: thin state around the shared code.

:class:`SimEngine` wraps one :class:`~fastroute.emulator.model.EngineModel` (the
emulator's performance model, unchanged) with what the simulator needs around it:
region, role, fault state, busy time. :class:`DataPlane` is one region's router built
from the proxy's own pieces — a policy from :func:`fastroute.policy.make_policy`, a
:class:`~fastroute.policy.StaticFleetView` over the pulled table,
:class:`~fastroute.guards.retry_budget.RetryBudget`,
:class:`~fastroute.guards.outlier.OutlierDetector`,
:func:`~fastroute.guards.admission.should_shed` and
:class:`~fastroute.guards.admission.QueueDelayGuard` — all driven by the virtual clock.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fastroute.emulator.model import EngineConfig, EngineModel
from fastroute.guards.admission import QueueDelayGuard
from fastroute.guards.outlier import OutlierDetector
from fastroute.guards.retry_budget import RetryBudget
from fastroute.hardware import HardwareProfile
from fastroute.policy import PairSelector, Policy, RouteRequest, make_policy
from fastroute.policy.base import prefill_cost_from_capacity
from fastroute.policy.key_exchange import KeyExchange
from fastroute.policy.marginal import (
    EngineState,
    MarginalCost,
    MarginalPairs,
    StaticEngineStateView,
)
from fastroute.policy.prefix_hrw import private_key_log
from fastroute.predict.interleave import PrefillInterleave
from fastroute.sim.scenario import DataPlaneConfig

__all__ = ["SimEngine", "DataPlane", "ProxyLoads", "engine_load", "STATE_POLICIES"]

#: Policies that read per-engine load (an :class:`~fastroute.policy.marginal.EngineState`);
#: the simulator fills the state before each of their decisions.
STATE_POLICIES = frozenset({"marginal-cost", "length-heuristic"})


def engine_load(model: EngineModel) -> tuple[float, float, float, float, float]:
    """``(queued prefill tokens, queued requests, running seqs, running context tokens,
    KV tokens in use)`` of an engine model, read exactly from its scheduler state.

    Queued tokens are the uncomputed prompt (and, for a request preempted or whose KV
    is arriving, context) tokens of waiting and loading requests plus the unprefilled
    rest of running ones; the running context is the computed tokens of the running
    batch. vLLM exports the counts and KV usage as metrics; the token sums are what the
    proxy estimates from its own bookkeeping (fastroute.proxy.path.engine_load).
    """
    # EngineModel has no public snapshot of its queues; read them (no mutation).
    q_tok = 0
    for r in model._waiting:
        q_tok += r.num_prompt_tokens + r.num_output - r.num_computed
    for r in model._loading:
        q_tok += r.num_prompt_tokens + r.num_output - r.num_computed
    ctx = 0
    for r in model._running:
        c = r.num_computed
        ctx += c
        rest = r.num_prompt_tokens - c
        if rest > 0:
            q_tok += rest
    kv = model.kv_usage * model.kv.num_blocks * 16
    return (
        float(q_tok),
        float(len(model._waiting) + len(model._loading)),
        float(len(model._running)),
        float(ctx),
        float(kv),
    )


class SimEngine:
    """One engine: the performance model plus fault state and accounting."""

    __slots__ = (
        "index",
        "name",
        "engine_id",
        "group",
        "region",
        "model_name",
        "role",
        "profile",
        "config",
        "model",
        "seed",
        "up",
        "generation",
        "step_token",
        "step_at",
        "lazy_from",
        "slowdown",
        "error_rate",
        "busy_s",
        "live",
        "capacity_rps",
        "steps",
        "preemptions_lost",
        "cache_hits_lost",
        "cache_queries_lost",
        "generated_lost",
        "type_name",
    )

    def __init__(
        self,
        index: int,
        name: str,
        engine_id: int,
        group: str,
        region: str,
        model_name: str,
        role: str,
        profile: HardwareProfile,
        config: EngineConfig,
        seed: int,
        type_name: str = "",
    ) -> None:
        self.index = index
        self.type_name = type_name or profile.name
        self.name = name
        self.engine_id = engine_id
        self.group = group
        self.region = region
        self.model_name = model_name
        self.role = role
        self.profile = profile
        self.config = config
        self.seed = seed
        self.model = EngineModel(profile, config, seed=seed)
        self.up = True
        self.generation = 0
        self.step_token = 0
        self.step_at: float | None = None
        # Start of a run of unobservable decode steps not yet applied (decode fast-forward).
        self.lazy_from: float | None = None
        self.slowdown = 1.0
        self.error_rate = 0.0
        self.busy_s = 0.0
        self.live: dict[str, Any] = {}
        self.capacity_rps = 0.0
        self.steps = 0
        # Counters of models discarded by crashes (a restart starts a fresh model).
        self.preemptions_lost = 0
        self.cache_hits_lost = 0
        self.cache_queries_lost = 0
        self.generated_lost = 0

    def restart_model(self) -> None:
        """Replace the model by a fresh one (a crash loses the KV cache and every request)."""
        m = self.model
        self.preemptions_lost += m.num_preemptions_total
        self.cache_hits_lost += m.prefix_cache_hits_total
        self.cache_queries_lost += m.prefix_cache_queries_total
        self.generated_lost += m.generation_tokens_total
        self.generation += 1
        self.model = EngineModel(self.profile, self.config, seed=self.seed + self.generation)
        self.model.slowdown = self.slowdown
        self.live.clear()
        self.step_at = None
        self.lazy_from = None
        self.step_token += 1  # a step event of the old model must not run the new one

    def sync(self, now_s: float) -> int:
        """Apply the pending fast-forwarded decode steps that start before ``now_s``.

        Call before anything touches the model at ``now_s`` (submit, fault, stats);
        the caller then re-schedules the engine's next step. Returns the steps applied.
        """
        start = self.lazy_from
        if start is None:
            return 0
        self.lazy_from = None
        k, _, busy = self.model.fast_forward(start, now_s)
        self.busy_s += busy
        self.steps += k
        return k

    @property
    def preemptions_total(self) -> int:
        """Preemptions over the whole run (all model generations)."""
        return self.preemptions_lost + self.model.num_preemptions_total

    @property
    def cache_hit_tokens(self) -> tuple[int, int]:
        """(hit, queried) prompt tokens of the prefix cache over the whole run."""
        m = self.model
        return (
            self.cache_hits_lost + m.prefix_cache_hits_total,
            self.cache_queries_lost + m.prefix_cache_queries_total,
        )

    @property
    def token_counts(self) -> tuple[int, int, int]:
        """(queried, cached, generated) tokens over the whole run: what an engine's
        ``/metrics`` counters say (``vllm:prefix_cache_queries_total``, ``…_hits_total``,
        ``vllm:generation_tokens_total``)."""
        hit, queried = self.cache_hit_tokens
        return queried, hit, self.generated_lost + self.model.generation_tokens_total


class ProxyLoads:
    """What the workers of one proxy count together (the proxy's shared stats block):
    in-flight requests, tokens and queued prompt tokens per engine; and, when the proxies
    poll each other (``dataplane.peer_poll_interval_s``), the other proxies' queued prompt
    tokens as of this proxy's last poll (the proxy's ``EngineStats.peer_queued``); and
    the key log its workers' policies share (the proxy's ``{stats}.keys`` segment), into
    which each poll appends the other proxies' own entries when they exchange keys.

    Parameters
    ----------
    n_engines : int
    peers : bool
        Keep ``peer_queued`` (else None: this proxy sees its own queue only).
    key_log_entries : int
        Entries of the shared key log; 0: none (``key_log`` is None).
    key_exchange : bool
        Polls exchange key-log entries (needs ``key_log_entries``).
    """

    def __init__(
        self,
        n_engines: int,
        peers: bool = False,
        key_log_entries: int = 0,
        key_exchange: bool = False,
    ) -> None:
        self.in_flight = np.zeros(n_engines, dtype=np.int64)
        self.tokens = np.zeros(n_engines, dtype=np.int64)
        self.queued_tokens = np.zeros(n_engines, dtype=np.int64)
        self.peer_queued = np.zeros(n_engines, dtype=np.int64) if peers else None
        self.key_log: bytearray | None = None
        self.exchange: KeyExchange | None = None
        self._key_cursors: dict[int, int] = {}
        if key_log_entries:
            self.key_log = private_key_log(key_log_entries)
            if key_exchange:  # one channel: the simulator's proxies run one policy
                self.exchange = KeyExchange(self.key_log, ("proxy:sim",))

    def polled(self, others: list[ProxyLoads]) -> None:
        """A poll round: the other proxies' queued prompt tokens, now, and their own
        key-log entries since the last round."""
        if self.peer_queued is not None:
            self.peer_queued[:] = 0
            for other in others:
                self.peer_queued += other.queued_tokens
        if self.exchange is not None:
            for other in others:
                if other.exchange is not None:
                    export = other.exchange.export(self._key_cursors.get(id(other), -1))
                    self.exchange.absorb(export)
                    self._key_cursors[id(other)] = export.next


class DataPlane:
    """One region's router, made of the proxy's own policy and guard objects.

    Parameters
    ----------
    index : int
        Data-plane number.
    region : str
        Its region (clients of this region use it).
    policy_name : str
        Registered policy.
    config : DataPlaneConfig
    engine_ids : sequence of int
        Table order of the engines.
    weights : ndarray, shape (n_rows, n_engines)
        Initial table.
    pool_ids : sequence of int
        Pool of each engine for the ejection cap (its model).
    type_names : tuple of str
        Engine type names (calibration keys) of the :class:`EngineState`.
    engine_types : sequence of int
        Index into ``type_names`` per engine.
    policy_extra : dict
        Constructor arguments the simulator adds to ``config.policy_params``.
    shared_loads : ProxyLoads, optional
        The counts shared with the other workers of the same proxy (default: this data
        plane's own).
    capacity_rps : sequence of float, optional
        Each engine's capacity, as the proxy's ``capacity_rps``: the views' prefill cost
        (``prefill_cost_from_capacity``; default: the engines alike).

    Attributes
    ----------
    state : EngineState
        Per-engine load, kept across tables; filled by the simulator before each
        decision of a :data:`STATE_POLICIES` policy (``needs_state``).
    """

    def __init__(
        self,
        index: int,
        region: str,
        policy_name: str,
        config: DataPlaneConfig,
        engine_ids: list[int],
        weights: np.ndarray,
        pool_ids: list[int],
        *,
        type_names: tuple[str, ...] = ("a40",),
        engine_types: list[int] | None = None,
        policy_extra: dict[str, Any] | None = None,
        shared_loads: ProxyLoads | None = None,
        capacity_rps: Any = None,
    ) -> None:
        self.index = index
        self.prefill_cost = (
            None if capacity_rps is None else prefill_cost_from_capacity(capacity_rps)
        )
        self.region = region
        self.config = config
        params = {**config.policy_params, **(policy_extra or {})}
        self.policy: Policy = make_policy(policy_name, **params)
        self.needs_state = policy_name in STATE_POLICIES
        #: Ranks the (prefill, decode) pair of a disaggregated request when the policy
        #: prices pairs (``marginal-cost``: the transfer between the two engines counts).
        #: None: the prefill engine is ranked like a whole request and the decode engine is
        #: picked anew for each attempt.
        self.pairs: PairSelector | None = (
            MarginalPairs(self.policy) if isinstance(self.policy, MarginalCost) else None
        )
        #: The policy's FleetCalibration if it calibrates from observed timings
        #: (``marginal-cost``): the simulator feeds it as the proxy does.
        self.calibration = (
            getattr(self.policy, "calibration", None)
            if hasattr(self.policy, "observe_output")
            else None
        )
        self.engine_ids = engine_ids
        n = len(engine_ids)
        #: Prefilled prompt tokens per engine (the mixed-step decode feature), kept as
        #: the proxy's EngineLoad keeps it; only when the policy calibrates.
        self.interleave = PrefillInterleave(n) if self.calibration is not None else None
        self.type_names = type_names
        self.state = EngineState(n, type_names)
        if engine_types is not None:
            self.state.column("engine_type")[:] = engine_types
        self.proxy = shared_loads if shared_loads is not None else ProxyLoads(n)
        if self.proxy.key_log is not None:
            self.policy.attach_key_log(self.proxy.key_log, index, 0)
        self.loads = self.proxy.in_flight
        self.token_loads = self.proxy.tokens
        self.queued_loads = self.proxy.queued_tokens
        self.view = self._make_view(weights)
        self.shed_fraction = np.zeros(weights.shape[0])
        self.table_version = 0
        self.budget = RetryBudget(
            ratio=config.retry_ratio,
            min_retries_per_s=config.min_retries_per_s,
            ttl_s=config.retry_ttl_s,
            max_retries=config.max_attempts - 1,
        )
        self.outlier = (
            OutlierDetector(
                n,
                consecutive_failures=config.consecutive_failures,
                base_ejection_s=config.base_ejection_s,
                pool_ids=pool_ids,
            )
            if config.outlier_ejection
            else None
        )
        self.mask_version = -1
        self.guard = (
            QueueDelayGuard(
                config.max_concurrency,
                target_s=config.guard_target_s,
                interval_s=config.guard_interval_s,
                max_wait_s=config.guard_max_wait_s,
            )
            if config.shedding and config.max_concurrency
            else None
        )
        self.waiting: dict[int, Any] = {}  # guard ticket -> request

    def _make_view(
        self, weights: np.ndarray, published_loads: np.ndarray | None = None
    ) -> StaticEngineStateView:
        view = StaticEngineStateView(self.engine_ids, weights, type_names=self.type_names)
        view.state = self.state
        view.prefill_costs = self.prefill_cost
        if self.config.load_view == "global-stale" and published_loads is not None:
            # Every data plane sees the same fleet-wide snapshot until the next table.
            view.loads = published_loads
        else:
            # The owner updates these arrays in place; keep them across tables.
            view.loads = self.loads
            view.token_loads = self.token_loads
            view.queued_loads = self.queued_loads
            view.peer_queued = self.proxy.peer_queued
        return view

    def routed(self, route: RouteRequest, index: int, tokens: int, queued_tokens: int = 0) -> None:
        """An attempt of ``tokens`` (prompt + output budget) went to engine ``index``,
        ``queued_tokens`` of its prompt queued there until :meth:`prefilled`."""
        self.policy.on_routed(route, self.engine_ids[index])
        self.loads[index] += 1
        self.token_loads[index] += tokens
        self.queued_loads[index] += queued_tokens

    def prefilled(self, index: int, queued_tokens: int) -> None:
        """Engine ``index`` prefilled (or dropped) an attempt's ``queued_tokens``: as
        the proxy's ``QueuedPrefill.done`` (at the engine's first token, one network hop
        before the proxy sees it)."""
        self.queued_loads[index] -= queued_tokens

    def completed(self, route: RouteRequest, index: int, tokens: int, ok: bool) -> None:
        """That attempt left engine ``index`` (``ok``: it was served)."""
        self.loads[index] -= 1
        self.token_loads[index] -= tokens
        self.policy.on_complete(route, self.engine_ids[index], ok)

    def set_table(
        self,
        weights: np.ndarray,
        shed_fraction: np.ndarray,
        version: int,
        published_loads: np.ndarray | None = None,
    ) -> None:
        """Apply a pulled table (ignored if older than the one in use)."""
        if version <= self.table_version:
            return
        self.table_version = version
        self.view = self._make_view(weights, published_loads)
        self.shed_fraction = shed_fraction
        self.mask_version = -1  # re-apply the ejection mask to the new view

    def refresh_mask(self, now_s: float) -> None:
        """Push the ejection mask into the view if it changed."""
        outlier = self.outlier
        if outlier is None:
            return
        version = outlier.version_at(now_s)
        if version != self.mask_version:
            self.mask_version = version
            self.view.set_available(outlier.available_mask(now_s).astype(bool))
