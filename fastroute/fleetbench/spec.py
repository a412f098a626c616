"""The fleet benchmark's spec file (TOML): fleet, workload, load, routers, faults, SLOs.

Example (``examples/bench/`` has complete ones)::

    name = "chat-90"
    routers = ["fastroute", "sglang:cache_aware", "sglang:round_robin"]
    duration_s = 60
    load = 0.9                       # × Σ capacity_rps of the fleet, requests/s

    [slo]
    ttft_s = 2.0
    tbot_s = 0.1

    [fleet]
    regions = [{ name = "local" }]
    [[fleet.groups]]
    name = "a40"
    count = 4
    profile = "a40"
    model = "llama-3-8b"
    region = "local"
    capacity_rps = 1.5

    [workload]                       # fastroute.workload.ChatWorkload fields
    mean_turns = 4.0
    sources = [{ name = "local" }]
    models = [{ name = "llama-3-8b" }]

    [[faults]]                       # optional: POST /admin/fault on one engine at at_s
    at_s = 30.0
    engine = "a40-0"
    set = { slowdown = 3.0 }

Routers are named ``fastroute`` or ``fastroute:<policy>``, ``sglang:<policy>``,
``vllm-router:<policy>``, a key of ``[fastroute_variants]`` (fastroute with a policy and
its ``[policy.params.<policy>]``, ``hedge = true`` for hedged first tokens), or a key of
``[router_commands]`` (a command template,
see :mod:`fastroute.fleetbench.routers`)::

    routers = ["fastroute:round-robin", "mc-cal"]
    [fastroute_variants.mc-cal]
    policy = "marginal-cost"
    params = { calibrate = true, infeasible = "reject" }

Instead of ``[workload]`` a spec may name a workload family: ``[family]`` takes the
fields of :mod:`fastroute.workload.families` (``kind = "rag"`` ...; a trace path
relative to the spec file), open loop at ``load × capacity`` when ``load`` is given,
else at the family's own ``rate_rps``. Or it may replay traces: ``[replay]`` takes the fields of the
simulator's :class:`fastroute.workload.mix.ReplayMix` (trace paths relative to the spec
file); its requests are single-turn, open loop, at ``load × capacity`` when ``load`` is
given, else at the replay's own ``rate_rps``.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any

import msgspec

from fastroute.config import ControllerConfig, PolicyName
from fastroute.fleetbench.fleet import FleetSpec
from fastroute.workload.families import Family
from fastroute.workload.mix import ReplayMix

__all__ = [
    "SloSpec",
    "FaultSpec",
    "RouterCommand",
    "FastrouteVariant",
    "BenchSpec",
    "load_spec",
    "BenchSpecError",
]

_OPTS: dict[str, Any] = {"frozen": True, "kw_only": True, "forbid_unknown_fields": True}
Positive = Annotated[float, msgspec.Meta(gt=0)]
#: fastroute's controller period as deployed (``[controller] period_s``'s default).
_DEFAULT_PERIOD_S = ControllerConfig().period_s


class BenchSpecError(ValueError):
    """A spec file that cannot be used; the message names the file and the problem."""


class SloSpec(msgspec.Struct, **_OPTS):
    """The SLOs of goodput, seconds."""

    ttft_s: Positive = 2.0
    tbot_s: Positive = 0.1


class FaultSpec(msgspec.Struct, **_OPTS):
    """A fault applied to one engine ``at_s`` seconds after each router's traffic starts.

    ``set`` is the body of the emulator's ``POST /admin/fault`` (``slowdown``,
    ``error_rate``, ``error_status``, ``hang``, ...: fastroute.emulator.faults).
    """

    at_s: Annotated[float, msgspec.Meta(ge=0)]
    engine: str
    set: dict[str, float | int | bool]


class RouterCommand(msgspec.Struct, **_OPTS):
    """A router started from a command template.

    Attributes
    ----------
    command : tuple of str
        Arguments; placeholders ``{python}``, ``{host}``, ``{port}``,
        ``{metrics_port}``, ``{worker_urls_csv}``; an argument that is exactly
        ``{worker_urls}`` becomes one argument per engine URL.
    requires_module : str, optional
        Python module that must be importable (else the router is reported unavailable).
    requires_executable : str, optional
        Program that must be on PATH or next to the Python executable.
    """

    command: Annotated[tuple[str, ...], msgspec.Meta(min_length=1)]
    requires_module: str | None = None
    requires_executable: str | None = None


class FastrouteVariant(msgspec.Struct, **_OPTS):
    """fastroute with a chosen policy and tunables (a router of ``[fastroute_variants]``).

    Attributes
    ----------
    policy : str
        ``policy.default`` of the proxies.
    params : table
        Rendered as ``[policy.params.<policy>]`` (``fastroute.policy.make_policy``'s
        keyword tunables; checked when the spec is loaded).
    hardware : str
        If set, the ``hardware`` label of every engine in this router's config (the
        engines still run their profiles): e.g. ``"a40-48g"``, a label naming no built-in
        profile, so marginal cost starts from the default type's constants — the
        "unprofiled" start of experiment (h), side by side with the profiled one.
    hedge : bool
        ``hedge = true`` on the config's classes: hedged first tokens
        (docs/failure-handling.md), side by side with the same policy unhedged.
    workers : int
        ``proxy.workers`` of each proxy (1–16).
    proxies : int
        Proxies per source cluster (1–8), sharing nothing but the controller's table (as
        on separate hosts); the client sends its requests to them in turn, request by
        request (a stateless balancer in front), so affinity must hold across them.
    peers : bool
        With several proxies in the run, each lists all the others as ``proxy.peers``
        (they poll each other's queued prompt tokens; default true, what a deployment of
        several proxies should configure). False: each sees its own queue only.
    proxy : table
        Further ``[proxy]`` keys of each proxy's config (e.g. ``key_log_entries = 0``),
        checked against ``fastroute.config.ProxyConfig`` when the spec is loaded; not
        the keys the benchmark sets itself (:data:`GENERATED_PROXY_KEYS`).
    """

    policy: PolicyName
    params: dict[str, bool | int | float | str] = {}
    hardware: Annotated[str, msgspec.Meta(max_length=64, pattern=r"^([A-Za-z0-9._-]+)?$")] = ""
    hedge: bool = False
    workers: Annotated[int, msgspec.Meta(ge=1, le=16)] = 1
    proxies: Annotated[int, msgspec.Meta(ge=1, le=8)] = 1
    peers: bool = True
    proxy: dict[str, bool | int | float | str] = {}


#: ``[proxy]`` keys the benchmark writes into every proxy's config itself.
GENERATED_PROXY_KEYS = frozenset(
    {"host", "port", "workers", "cluster", "table_name", "stats_name", "report_interval_s",
     "drain_timeout_s", "controller_url", "peers"}
)  # fmt: skip


class BenchSpec(msgspec.Struct, **_OPTS):
    """A benchmark: one fleet and one workload, run through each router in turn.

    Attributes
    ----------
    name : str
    description : str
    routers : tuple of str
        Routers under test, in run order.
    duration_s : float
        Measured traffic per router: no request is sent after ``warmup_s + duration_s``.
    warmup_s : float
        Traffic before the measured window (sessions start from t = 0; requests sent
        before ``warmup_s`` are not counted).
    drain_s : float
        Then requests in flight get this long before they are cancelled.
    seed : int
        Workload seed (the same sessions for every router) and engine seeds.
    load : float, optional
        Target offered load as a fraction of Σ ``capacity_rps``: sets the workload's
        session rate (open loop). Exclusive with ``concurrency``.
    concurrency : int, optional
        Closed loop with this many concurrent sessions.
    stream : bool
        SSE streaming.
    send_session_id : bool
        Send ``x-session-id`` (off: routers key on the conversation itself).
    max_requests : int
        Cap on requests per router run.
    max_in_flight : int
        Client-side bound on concurrent requests.
    request_timeout_s : float
        Per request.
    overhead_requests : int
        Sequential short requests, direct and through the router, before the run
        (routing overhead at low load); 0 skips that phase.
    controller_period_s : float
        fastroute controller period; default: the controller's own default
        (``[controller] period_s``), so the benchmark runs fastroute as deployed.
    controller : bool
        Run fastroute's controller (default). Off: the proxies alone, on their config's
        capacity weights, never shedding (the simulator's ``optimiser = "static"``).
    slo : SloSpec
    fleet : FleetSpec
    workload : table, optional
        ``fastroute.workload.ChatWorkload`` fields; ``rate_sessions_per_s`` is computed
        from ``load`` when ``load`` is set.
    replay : ReplayMix, optional
        Trace replay instead of ``workload``.
    family : Family, optional
        A workload family instead of ``workload`` (exactly one of the three).
    faults : tuple of FaultSpec
    router_commands : table of RouterCommand
        Custom routers by name.
    fastroute_variants : table of FastrouteVariant
        fastroute routers with their own policy and tunables, by name.
    base_dir : str
        Directory relative trace paths start from (the spec file's, set by
        :func:`load_spec`).
    """

    name: str
    fleet: FleetSpec
    description: str = ""
    routers: Annotated[tuple[str, ...], msgspec.Meta(min_length=1)] = ("fastroute",)
    duration_s: Positive = 60.0
    warmup_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    drain_s: Annotated[float, msgspec.Meta(ge=0)] = 15.0
    seed: int = 0
    load: Positive | None = None
    concurrency: Annotated[int, msgspec.Meta(ge=1)] | None = None
    stream: bool = True
    send_session_id: bool = False
    max_requests: Annotated[int, msgspec.Meta(ge=1)] = 100_000
    max_in_flight: Annotated[int, msgspec.Meta(ge=1)] = 512
    request_timeout_s: Positive = 60.0
    overhead_requests: Annotated[int, msgspec.Meta(ge=0)] = 30
    controller_period_s: Positive = _DEFAULT_PERIOD_S
    controller: bool = True
    slo: SloSpec = SloSpec()
    workload: dict[str, Any] | None = None
    replay: ReplayMix | None = None
    family: Family | None = None
    faults: tuple[FaultSpec, ...] = ()
    router_commands: dict[str, RouterCommand] = {}
    fastroute_variants: dict[str, FastrouteVariant] = {}
    base_dir: str = ""


def load_spec(path: str | Path) -> BenchSpec:
    """Read and check a spec file.

    Raises
    ------
    BenchSpecError
        Unreadable, not TOML, wrong types or unknown keys (with msgspec's JSON path),
        or inconsistent: not exactly one of ``[workload]``, ``[replay]`` and ``[family]``, workload
        sources that are not fleet regions, models served by no engine, faults on
        unknown engines, both or neither of ``load`` and ``concurrency`` (a replay is
        open loop: ``load`` optional, no ``concurrency``), variant tunables the policy
        does not take, a variant named like another router.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
        data.setdefault("base_dir", str(path.resolve().parent))
        spec = msgspec.convert(data, BenchSpec)
    except (OSError, tomllib.TOMLDecodeError, msgspec.ValidationError, ValueError) as exc:
        raise BenchSpecError(f"{path}: {exc}") from None
    given = [spec.workload is not None, spec.replay is not None, spec.family is not None]
    if sum(given) != 1:
        raise BenchSpecError(f"{path}: give exactly one of [workload] and [replay] (or [family])")
    if spec.replay is not None:
        _check_replay(path, spec, spec.replay)
    elif spec.family is not None:
        _check_family(path, spec, spec.family)
    else:
        _check_workload(path, spec, spec.workload or {})
    names = {f"{g.name}-{i}" for g in spec.fleet.groups for i in range(g.count)}
    for fault in spec.faults:
        if fault.engine not in names:
            raise BenchSpecError(f"{path}: fault on unknown engine {fault.engine!r}")
    _check_variants(path, spec)
    return spec


def _check_workload(path: Path, spec: BenchSpec, table: dict[str, Any]) -> None:
    from fastroute.workload import ChatWorkload, WorkloadError

    if (spec.load is None) == (spec.concurrency is None):
        raise BenchSpecError(f"{path}: give exactly one of `load` (open loop) and `concurrency`")
    try:
        workload = ChatWorkload.from_dict(table)
    except WorkloadError as exc:
        raise BenchSpecError(f"{path}: [workload]: {exc}") from None
    regions = {r.name for r in spec.fleet.regions}
    for src in workload.sources:
        if src.name not in regions:
            raise BenchSpecError(
                f"{path}: workload source {src.name!r} is not a fleet region {sorted(regions)}"
            )
    served = set(spec.fleet.models)
    for model in workload.models:
        if model.name not in served:
            raise BenchSpecError(f"{path}: workload model {model.name!r} is served by no engine")


def _check_replay(path: Path, spec: BenchSpec, mix: ReplayMix) -> None:
    from fastroute.workload import WorkloadError

    if spec.concurrency is not None:
        raise BenchSpecError(f"{path}: [replay] is open loop: remove `concurrency`")
    try:
        mix.check()
    except WorkloadError as exc:
        raise BenchSpecError(f"{path}: [replay]: {exc}") from None
    if mix.model not in spec.fleet.models:
        raise BenchSpecError(f"{path}: replay model {mix.model!r} is served by no engine")
    for comp in mix.components:
        trace = Path(comp.path)
        if not trace.is_absolute():
            trace = Path(spec.base_dir) / trace
        if not trace.is_file():
            raise BenchSpecError(
                f"{path}: replay component {comp.name!r}: trace file not found: {trace}"
            )


def _check_family(path: Path, spec: BenchSpec, family: Family) -> None:
    if spec.concurrency is not None:
        raise BenchSpecError(f"{path}: [family] is open loop: remove `concurrency`")
    if family.model not in spec.fleet.models:
        raise BenchSpecError(f"{path}: family model {family.model!r} is served by no engine")
    trace = getattr(family, "trace", "")
    if trace:
        trace_path = Path(trace)
        if not trace_path.is_absolute():
            trace_path = Path(spec.base_dir) / trace_path
        if not trace_path.is_file():
            raise BenchSpecError(f"{path}: family trace file not found: {trace_path}")


def _check_variants(path: Path, spec: BenchSpec) -> None:
    from fastroute.policy import PolicyConfigError, make_policy

    for name, variant in spec.fastroute_variants.items():
        reserved = ("fastroute", "sglang", "vllm-router")  # prefixes of the built-in routers
        if name in spec.router_commands or name.partition(":")[0] in reserved:
            raise BenchSpecError(
                f"{path}: fastroute variant {name!r}: name taken by another router"
            )
        try:
            make_policy(variant.policy, **variant.params)
        except (PolicyConfigError, TypeError, ValueError) as exc:
            raise BenchSpecError(f"{path}: fastroute variant {name!r}: {exc}") from None
        _check_proxy_keys(path, name, variant.proxy)


def _check_proxy_keys(path: Path, name: str, settings: dict[str, Any]) -> None:
    from fastroute.config import ProxyConfig

    taken = sorted(GENERATED_PROXY_KEYS & settings.keys())
    if taken:
        raise BenchSpecError(
            f"{path}: fastroute variant {name!r}: proxy keys {taken} are set by the benchmark"
        )
    try:
        msgspec.convert(settings, ProxyConfig)
    except (msgspec.ValidationError, ValueError) as exc:
        raise BenchSpecError(f"{path}: fastroute variant {name!r}: proxy: {exc}") from None
