"""Scenario files: one TOML document describes a whole simulated deployment.

Sections (all optional except ``[[engines]]``; field reference in docs/simulator.md):
``[slo]``, ``[[regions]]``, ``[network]``, ``[[engines]]``, ``[workload]`` (a
:class:`~fastroute.workload.ChatWorkload`) or ``[trace]``, ``[dataplane]``,
``[control]``, ``[[faults]]``; ``[replay]`` (a bursty mix of traces,
:class:`~fastroute.workload.mix.ReplayMix`) or ``[family]`` (a workload family,
:mod:`fastroute.workload.families`) instead of ``[workload]``/``[trace]``.
Decoded with ``msgspec.convert`` into frozen Structs that reject unknown keys, then
checked across fields (names unique, references resolve).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec

from fastroute.emulator.profiles import true_profile
from fastroute.hardware import get_profile
from fastroute.policy.registry import DEFAULT_POLICY
from fastroute.sim.metrics import Slo
from fastroute.workload import ChatWorkload, WorkloadError
from fastroute.workload.families import Family
from fastroute.workload.mix import ReplayComponent, ReplayMix

__all__ = [
    "ScenarioError",
    "Region",
    "Network",
    "EngineGroup",
    "TraceSource",
    "DataPlaneConfig",
    "ControlConfig",
    "Fault",
    "Scenario",
    "Variant",
    "ReplayMix",
    "ReplayComponent",
    "load_scenario",
    "load_scenario_dict",
    "apply_settings",
    "parse_setting",
]

_OPTS: dict[str, Any] = {"frozen": True, "kw_only": True, "forbid_unknown_fields": True}


class ScenarioError(WorkloadError):
    """A scenario file that cannot be simulated (the message names the file and the field)."""


class Region(msgspec.Struct, **_OPTS):
    """A region: where engines run and clients (one data plane per region) come from.

    Attributes
    ----------
    name : str
        Region name (workload ``sources`` refer to it).
    """

    name: str


class Network(msgspec.Struct, **_OPTS):
    """One-way network latency between regions (client/proxy ↔ engine, engine ↔ engine).

    Attributes
    ----------
    intra_region_ms : float
        Latency inside a region.
    inter_region_ms : float
        Latency between two regions not listed in ``latency_ms``.
    latency_ms : dict
        ``{from: {to: ms}}`` overrides (symmetric if only one direction is given).
    """

    intra_region_ms: float = 0.5
    inter_region_ms: float = 40.0
    latency_ms: dict[str, dict[str, float]] = {}


class EngineGroup(msgspec.Struct, **_OPTS):
    """``count`` identical engines named ``{name}-{i}``.

    Attributes
    ----------
    name : str
        Group name (engine name prefix).
    count : int
        Engines in the group, ≥ 1.
    region : str
        Region they run in (default: the first region).
    profile : str
        Hardware profile (:data:`fastroute.hardware.PROFILES`).
    model : str
        Model they serve.
    role : {"mixed", "prefill", "decode"}
        Mixed engines serve whole requests; a model with prefill and decode groups is
        served disaggregated (prefill with KV held, then decode with the KV transferred).
    kind : {"vllm", "sglang"}
        The engines' software, for a disaggregated model's protocol (its prefill and
        decode groups must agree): ``vllm`` is sequential (the prefill's answer returns
        to the data plane, which then sends the decode request), ``sglang`` concurrent
        (both requests leave at once; the decode starts when the prefill's KV arrives,
        with no round trip through the data plane in between).
    max_num_seqs : int
        vLLM ``max_num_seqs``.
    max_num_batched_tokens : int or None
        Token budget per step (profile default if None).
    num_blocks : int or None
        Override the KV capacity in 16-token blocks.
    max_waiting : int
        Engine waiting-queue bound (beyond it attempts get 429).
    enable_prefix_caching : bool
        vLLM prefix caching.
    capacity_rps : float or None
        Capacity the control plane assumes (req/s at ρ = 1); estimated by a saturating
        replay of the workload's requests if None.
    step_time_factors : dict of str to float
        The engines' *true* step-time coefficients relative to the profile's
        (``{"b0_s" = 1.5}``: 50 % more per-step overhead than the datasheet estimate);
        the marginal-cost policy starts from the profile's and must calibrate
        (:func:`fastroute.emulator.profiles.true_profile`).
    hardware : str
        The label the router knows the group by (the proxy config's ``hardware``);
        default: the profile's name. The marginal-cost policy starts from the datasheet
        constants of the built-in profile of that name; a label naming none (an operator's
        own, ``"a40-48g"``) starts it from the default type's (``a40``, Llama-3-8B), as
        the proxy does.
    """

    name: str
    count: int = 1
    region: str = ""
    profile: str = "h100"
    model: str = "demo-8b"
    role: Literal["mixed", "prefill", "decode"] = "mixed"
    kind: Literal["vllm", "sglang"] = "vllm"
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    num_blocks: int | None = None
    max_waiting: int = 1024
    enable_prefix_caching: bool = True
    capacity_rps: float | None = None
    step_time_factors: dict[str, float] = {}
    hardware: str = ""


class TraceSource(msgspec.Struct, **_OPTS):
    """Replay a trace instead of generating sessions (:func:`fastroute.workload.load_trace`).

    Attributes
    ----------
    path : str
        CSV/JSONL file, relative to the scenario file.
    limit : int or None
        Records to read.
    time_scale : float
        Inter-arrival time multiplier.
    sources : tuple of str
        Regions assigned round-robin (default: all regions).
    model : str
        Model of records that name none.
    """

    path: str
    limit: int | None = None
    time_scale: float = 1.0
    sources: tuple[str, ...] = ()
    model: str = "demo-8b"


class DataPlaneConfig(msgspec.Struct, **_OPTS):
    """The per-region router: policy, failover, retry budget, ejection, shedding.

    Attributes
    ----------
    policy : str
        Registered policy name (overridden by ``--policy``).
    policy_params : dict
        The policy's tunables.
    k : int
        Failover ranking length.
    retry : {"budget", "fixed", "none"}
        ``budget``: retries allowed by :class:`~fastroute.guards.retry_budget.RetryBudget`
        up to ``max_attempts``; ``fixed``: always retry up to ``max_attempts``.
    max_attempts : int
        Attempts per request including the first.
    max_migrations : int
        Mid-stream migrations per request (the proxy's ``retry.max_migrations``): an
        attempt whose engine fails after its first token goes on on the next engine
        with the prompt plus the tokens generated so far and the rest of ``max_tokens``,
        taking a retry from the budget (not bounded by ``max_attempts``). 0: such an
        attempt is retried whole, like any failure.
    retry_ratio, min_retries_per_s, retry_ttl_s : float
        Retry budget parameters.
    outlier_ejection : bool
        Local consecutive-failure ejection (:class:`~fastroute.guards.outlier.OutlierDetector`).
    consecutive_failures : int
        Failures in a row that eject.
    base_ejection_s : float
        First ejection length.
    shedding : bool
        Apply the control plane's sticky shed fractions and the queue-delay guard.
    max_concurrency : int or None
        Queue-delay guard slots per data plane (None: no guard).
    guard_target_s, guard_interval_s, guard_max_wait_s : float
        Queue-delay guard parameters.
    connect_timeout_s : float
        How long an attempt to an unreachable engine takes to fail.
    workers : int
        Policy instances per proxy (the proxy's ``proxy.workers``): each request goes to
        one of them uniformly at random (seeded), as the kernel's ``SO_REUSEPORT``
        spreads connections. Each worker has its own policy state (cache-aware's tree,
        round-robin's cursor), retry budget and ejection state; the in-flight request and
        token counts the policies read are shared by all workers of a proxy (the proxy's
        shared-memory stats block).
    proxies : int
        Proxies (data planes) per region; each request goes to one of its region's
        uniformly at random (an L4 load balancer). Each proxy has its own in-flight counts.
    hedge : bool
        Hedged first tokens for every class (the proxy's ``[[classes]] hedge``;
        :mod:`fastroute.sim.hedging`): after the delay without a first token the
        request also goes to the runner-up; the first token wins, the other attempt is
        cancelled on its engine. One retry from the budget each; none while shedding.
    hedge_quantile, hedge_floor_s, hedge_window, hedge_min_samples
        The delay, as the proxy's ``retry.hedge_*``: the quantile of recent client
        first-token times per class, its floor (s), the window and the samples below
        which the delay is the SLO's ``ttft_s``.
    load_view : {"local", "global-stale"}
        What load-aware policies see as in-flight counts: this data plane's own
        (``local``, as the proxy does), or the fleet-wide counts the control plane
        published with the last table (``global-stale``: the herd experiment).
    peer_poll_interval_s : float
        Each proxy polls the others' queued prompt tokens per engine this often (s) and
        adds them to its own until the next poll (the proxy's ``proxy.peers`` /
        ``peer_poll_interval_s``, :mod:`fastroute.proxy.background.peer_queues`); the
        proxies poll out of phase (a random offset each) and the answer is taken as of
        the poll. 0 (default): no polls, each proxy sees its own queue only.
    key_log_entries : int
        The key log the workers of one proxy share (the proxy's ``proxy.key_log_entries``,
        :mod:`fastroute.tables.key_log`): every worker's ``prefix-hrw`` tables count the
        proxy's routed requests, not only its own. 0: each worker counts its own. Default
        4096, as the proxy's; used when ``workers > 1`` or the proxies exchange keys.
    peer_key_exchange : bool
        The peer polls carry each proxy's own key-log entries into the others' logs (the
        proxy's ``proxy.peer_key_exchange``, :mod:`fastroute.policy.key_exchange`):
        default true; with ``peer_poll_interval_s > 0``, ``key_log_entries > 0`` and more
        than one proxy.
    routing_key : {"session", "conversation", "completion"}
        Each request's routing key, as the proxy derives it
        (:mod:`fastroute.proxy.path.routing_key`): ``"session"`` (default) the session's
        own id at its conversation's depth (a chat client whose first messages are its
        own); ``"conversation"`` the text of the system prompt and the first user message
        at that depth, so sessions that open alike share it (the proxy's key for a chat
        without a session id: one prompt sent by many is one key); ``"completion"`` the
        prompt's first 1024 bytes and no conversation depth (the completions API).
    """

    policy: str = DEFAULT_POLICY
    policy_params: dict[str, Any] = {}
    k: int = 3
    retry: Literal["budget", "fixed", "none"] = "budget"
    max_attempts: int = 2
    max_migrations: int = 0
    retry_ratio: float = 0.1
    min_retries_per_s: float = 2.0
    retry_ttl_s: float = 10.0
    outlier_ejection: bool = True
    consecutive_failures: int = 5
    base_ejection_s: float = 30.0
    shedding: bool = True
    max_concurrency: int | None = None
    guard_target_s: float = 0.05
    guard_interval_s: float = 0.5
    guard_max_wait_s: float = 5.0
    connect_timeout_s: float = 0.5
    workers: int = 1
    proxies: int = 1
    load_view: Literal["local", "global-stale"] = "local"
    peer_poll_interval_s: float = 0.0
    key_log_entries: int = 4096
    peer_key_exchange: bool = True
    routing_key: Literal["session", "conversation", "completion"] = "session"
    hedge: bool = False
    hedge_quantile: float = 0.95
    hedge_floor_s: float = 0.05
    hedge_window: int = 512
    hedge_min_samples: int = 20


class ControlConfig(msgspec.Struct, **_OPTS):
    """The control-plane loop.

    Attributes
    ----------
    optimiser : str
        ``"static"`` (capacity-proportional), ``"nearest"`` (own region only), or a name
        :mod:`controller.sim_optimiser` provides (``"lp"``, ``"p-controller"``).
    params : dict
        Keyword arguments of the optimiser factory.
    period_s : float
        Control period T.
    lag_periods : int
        Signal lag D: the optimiser sees the window that ended D periods ago.
    pull_jitter_s : float
        Each data plane picks up a new table uniformly within this delay.
    """

    optimiser: str = "static"
    params: dict[str, Any] = {}
    period_s: float = 5.0
    lag_periods: int = 0
    pull_jitter_s: float = 0.5


class Fault(msgspec.Struct, **_OPTS):
    """An injected fault during ``[start_s, start_s + duration_s)``.

    Attributes
    ----------
    kind : {"crash", "slowdown", "errors", "partition", "controller-outage", "spike"}
        Engine crash (in-flight attempts fail, cache lost), step-time multiplier,
        error probability per attempt (fails at its first token), regions cut off from
        each other, no control updates, demand multiplier.
    start_s, duration_s : float
        Window.
    engines : tuple of str
        Engines affected (crash, slowdown, errors); group names select whole groups.
    regions : tuple of str
        ``partition``: two or more regions cut from each other; ``spike``: sources
        affected (empty = all).
    factor : float
        ``slowdown`` multiplier or ``spike`` rate multiplier.
    error_rate : float
        ``errors``: probability an attempt fails.
    """

    kind: Literal["crash", "slowdown", "errors", "partition", "controller-outage", "spike"]
    start_s: float = 0.0
    duration_s: float = 1e12
    engines: tuple[str, ...] = ()
    regions: tuple[str, ...] = ()
    factor: float = 3.0
    error_rate: float = 0.5


class Variant(msgspec.Struct, **_OPTS):
    """One arm of ``fastroute sim compare``: a label and the settings it changes.

    Attributes
    ----------
    name : str
        Label in the comparison.
    policy : str or None
        Policy of this arm (default: the command's or the scenario's).
    set : dict
        Dotted scenario keys to values, e.g. ``{"dataplane.retry" = "fixed"}``.
    """

    name: str
    policy: str | None = None
    set: dict[str, Any] = {}


class Scenario(msgspec.Struct, **_OPTS):
    """A simulated deployment and its workload.

    Attributes
    ----------
    name : str
        Label in reports.
    description : str
        What the scenario shows.
    duration_s : float
        New sessions start in ``[0, duration_s)``.
    drain_s : float
        Extra time for sessions still running; whatever is unfinished then is counted
        ``failed`` with reason ``"unfinished"``.
    warmup_s : float
        Requests arriving before this are excluded from the metrics.
    seed : int
        Default seed (``--seed`` overrides).
    target_load : float or None
        If set, the session rate is scaled so that offered requests/s equal this
        fraction of the fleet's total capacity.
    slo : Slo
    regions : tuple of Region
    network : Network
    engines : tuple of EngineGroup
    workload : ChatWorkload
    trace : TraceSource or None
    replay : ReplayMix or None
        Bursty mix of traces (experiment h); excludes ``trace``.
    family : Family or None
        A workload family (:mod:`fastroute.workload.families`, ``kind`` selects it)
        instead of ``workload``; excludes ``trace`` and ``replay``. ``target_load`` sets
        its ``rate_rps``.
    dataplane : DataPlaneConfig
    control : ControlConfig
    faults : tuple of Fault
    variants : tuple of Variant
        Arms of ``fastroute sim compare`` (empty: one arm per ``--policies`` entry).
    base_dir : str
        Directory relative trace paths start from (set by :func:`load_scenario`).
    """

    name: str = "scenario"
    description: str = ""
    duration_s: float = 300.0
    drain_s: float = 300.0
    warmup_s: float = 0.0
    seed: int = 1
    target_load: float | None = None
    slo: Slo = Slo()
    regions: tuple[Region, ...] = (Region(name="local"),)
    network: Network = Network()
    engines: tuple[EngineGroup, ...] = ()
    workload: ChatWorkload = ChatWorkload()
    trace: TraceSource | None = None
    replay: ReplayMix | None = None
    family: Family | None = None
    dataplane: DataPlaneConfig = DataPlaneConfig()
    control: ControlConfig = ControlConfig()
    faults: tuple[Fault, ...] = ()
    variants: tuple[Variant, ...] = ()
    base_dir: str = ""


def _check(s: Scenario, where: str) -> None:
    def bad(msg: str) -> None:
        raise ScenarioError(f"{where}: {msg}")

    regions = [r.name for r in s.regions]
    if not regions or len(set(regions)) != len(regions):
        bad(f"regions must be non-empty and unique, got {regions}")
    if not s.engines:
        bad("at least one [[engines]] group is needed")
    names = [g.name for g in s.engines]
    if len(set(names)) != len(names):
        bad(f"engine group names must be unique, got {names}")
    for g in s.engines:
        if g.count < 1:
            bad(f"engines {g.name!r}: count must be >= 1")
        if g.region and g.region not in regions:
            bad(f"engines {g.name!r}: unknown region {g.region!r}; regions: {regions}")
        try:
            profile = get_profile(g.profile)
        except KeyError as exc:
            bad(f"engines {g.name!r}: {exc.args[0]}")
        try:
            true_profile(profile, g.step_time_factors)
        except ValueError as exc:
            bad(f"engines {g.name!r}: step_time_factors: {exc}")
    models = {g.model for g in s.engines}
    for src in s.workload.sources if s.family is None else ():
        if src.name not in regions:
            bad(f"workload source {src.name!r} is not a region; regions: {regions}")
    for m in s.workload.models:
        if m.name not in models and s.trace is None and s.replay is None and s.family is None:
            bad(f"workload model {m.name!r} is served by no engine group")
    for m in models:
        roles = {g.role for g in s.engines if g.model == m}
        if "mixed" in roles and roles != {"mixed"}:
            bad(f"model {m!r}: mix of mixed and prefill/decode groups is not supported")
        if roles & {"prefill", "decode"} and roles != {"prefill", "decode"}:
            bad(f"model {m!r}: disaggregated serving needs both prefill and decode groups")
        kinds = {g.kind for g in s.engines if g.model == m and g.role != "mixed"}
        if len(kinds) > 1:
            bad(
                f"model {m!r}: prefill/decode groups of kinds {sorted(kinds)} speak different "
                "P/D protocols; make them all 'vllm' or all 'sglang'"
            )
    if s.replay is not None:
        if s.trace is not None:
            bad("[replay] and [trace] are exclusive")
        if s.replay.model not in models:
            bad(f"replay model {s.replay.model!r} is served by no engine group")
        try:
            s.replay.check()
        except WorkloadError as exc:
            bad(str(exc))
    if s.family is not None:
        if s.trace is not None or s.replay is not None:
            bad("[family] excludes [trace] and [replay]")
        if s.family.model not in models:
            bad(f"family model {s.family.model!r} is served by no engine group")
    if not (s.duration_s > 0 and s.drain_s >= 0 and 0 <= s.warmup_s < s.duration_s):
        bad("need duration_s > 0, drain_s >= 0 and 0 <= warmup_s < duration_s")
    if s.target_load is not None and not s.target_load > 0:
        bad("target_load must be > 0")
    c = s.control
    if not (c.period_s > 0 and c.lag_periods >= 0 and c.pull_jitter_s >= 0):
        bad("control needs period_s > 0, lag_periods >= 0, pull_jitter_s >= 0")
    d = s.dataplane
    if d.k < 1 or d.max_attempts < 1:
        bad("dataplane needs k >= 1 and max_attempts >= 1")
    if d.max_migrations < 0:
        bad("dataplane needs max_migrations >= 0")
    if not 0.5 < d.hedge_quantile < 1.0:
        bad(f"dataplane.hedge_quantile must be in (0.5, 1), got {d.hedge_quantile}")
    if not d.hedge_floor_s > 0 or d.hedge_window < 16 or d.hedge_min_samples < 1:
        bad("dataplane needs hedge_floor_s > 0, hedge_window >= 16, hedge_min_samples >= 1")
    if d.workers < 1 or d.proxies < 1:
        bad(f"dataplane needs workers >= 1 and proxies >= 1, got {d.workers} and {d.proxies}")
    if not d.peer_poll_interval_s >= 0:
        bad(f"dataplane.peer_poll_interval_s must be >= 0, got {d.peer_poll_interval_s}")
    entries = d.key_log_entries
    if entries and (entries < 16 or entries & (entries - 1)):
        bad(f"dataplane.key_log_entries must be 0 or a power of two >= 16, got {entries}")
    groups = set(names)
    engine_names = {f"{g.name}-{i}" for g in s.engines for i in range(g.count)}
    for f in s.faults:
        for e in f.engines:
            if e not in groups and e not in engine_names:
                bad(f"fault {f.kind!r}: unknown engine or group {e!r}")
        for r in f.regions:
            if r not in regions:
                bad(f"fault {f.kind!r}: unknown region {r!r}")
        if f.kind == "partition" and len(f.regions) < 2:
            bad("a partition fault needs at least two regions")
        if f.kind in ("crash", "slowdown", "errors") and not f.engines:
            bad(f"fault {f.kind!r} needs engines")
        if not (0 <= f.error_rate <= 1 and f.factor > 0 and f.duration_s > 0):
            bad(f"fault {f.kind!r}: need 0 <= error_rate <= 1, factor > 0, duration_s > 0")


def scenario_from_dict(data: dict[str, Any], where: str = "scenario") -> Scenario:
    """Convert and check a decoded TOML document.

    Raises
    ------
    ScenarioError
        Wrong types, unknown keys, or inconsistent references.
    """
    try:
        scenario = msgspec.convert(data, Scenario)
    except msgspec.ValidationError as exc:
        raise ScenarioError(f"{where}: {exc}") from None
    _check(scenario, where)
    return scenario


def load_scenario_dict(path: str | Path) -> dict[str, Any]:
    """Parse a scenario TOML file into a dict (``base_dir`` filled in).

    Raises
    ------
    ScenarioError
        Missing file or invalid TOML.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ScenarioError(f"scenario file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{path}: invalid TOML: {exc}") from None
    data.setdefault("base_dir", str(path.resolve().parent))
    return data


def parse_setting(text: str) -> tuple[str, Any]:
    """``"section.key=value"`` (value in TOML syntax; bare words are strings) → (key, value)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ScenarioError(f"expected KEY=VALUE, got {text!r}")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key, value


def apply_settings(data: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``data`` with dotted ``settings`` applied (tables created as needed)."""
    import copy

    out = copy.deepcopy(data)
    for dotted, value in settings.items():
        node = out
        parts = dotted.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ScenarioError(f"cannot set {dotted!r}: {part!r} is not a table")
            node = child
        node[parts[-1]] = value
    return out


def load_scenario(path: str | Path, settings: dict[str, Any] | None = None) -> Scenario:
    """Read a scenario TOML file, apply dotted ``settings``, convert and check it.

    Raises
    ------
    ScenarioError
        Missing file, invalid TOML, or an invalid scenario (file and JSON path named).
    """
    data = apply_settings(load_scenario_dict(path), settings or {})
    return scenario_from_dict(data, str(path))
