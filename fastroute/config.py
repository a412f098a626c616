"""Configuration of the proxy and the controller: one TOML file, frozen msgspec Structs.

The proxy (``fastroute serve``) and the controller (``fastroute controller``) read the
same file. It is parsed with :mod:`tomllib`, converted into the :class:`Config` tree
with ``msgspec.convert`` (types, ranges, unknown keys), then checked across fields
(names unique, references resolved, URLs well formed). Every failure is a
:class:`ConfigError` whose message names the file, what was expected and the JSON
path of the offending value, in msgspec's style::

    fastroute.toml: Expected `float` > 0.0 - at `$.timeouts.connect_timeout_s`
    fastroute.toml: duplicate engine name 'engine-1' (also $.engines[1]) - at `$.engines[2].name`

Units are part of every field name (``_s`` seconds, ``_ms`` milliseconds, ``_rps``
requests per second, ``_bytes``). ``docs/configuration.md`` is generated from the
Structs below by :func:`render_markdown` (``python -m fastroute.config``); a test
fails when it is stale. ``examples/fastroute.toml`` is a commented, working example.

Decisions the file format encodes:

* **Regions and zones.** Regions (clusters) are declared in ``[[network.regions]]``;
  each belongs to one residency zone. An engine's zone defaults to its region's zone;
  :func:`decode_config` fills it in, so consumers always see a concrete zone.
* **RTT matrix.** ``[network.rtt_ms]`` maps source region → destination region →
  milliseconds. A missing direction takes the other direction's value (symmetric
  default), a missing diagonal is 0, and every other pair must be given.
* **Hardware** is a label checked against ``hardware_classes``, which defaults to the
  built-in datasheet profiles' names (:mod:`fastroute.hardware`), so a typo fails at start
  while real fleets can declare their own classes.
* **Capacity** is in requests per second at the fleet's typical request mix
  (``capacity_rps``): it is the prior the data plane uses for capacity-proportional
  fallback weights before the controller has published, and the controller's starting
  point before it has fitted profiles from signals.
"""

from __future__ import annotations

import difflib
import hashlib
import inspect
import re
import sys
import tomllib
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import msgspec

from fastroute.errors import ConfigError
from fastroute.hardware import PROFILES

__all__ = [
    "ConfigError",
    "decode_engine",
    "Priority",
    "PolicyName",
    "Role",
    "EngineKind",
    "PDProtocol",
    "DEFAULT_BOOTSTRAP_PORT",
    "bootstrap_port_of",
    "pd_protocol_of",
    "PRIORITIES",
    "POLICY_NAMES",
    "DEFAULT_POLICY_NAME",
    "DEFAULT_HARDWARE_CLASSES",
    "RegionConfig",
    "NetworkConfig",
    "EngineConfig",
    "DiscoveryConfig",
    "DEFAULT_MAX_ENGINES",
    "DEFAULT_DISCOVERY_INTERVAL_S",
    "DEFAULT_DISCOVERY_TIMEOUT_S",
    "TenantConfig",
    "ClassConfig",
    "PolicyConfig",
    "RetryConfig",
    "EjectionConfig",
    "AdmissionConfig",
    "TimeoutsConfig",
    "LimitsConfig",
    "ProxyConfig",
    "ShedPenaltiesConfig",
    "DeratingConfig",
    "ControllerConfig",
    "TracingConfig",
    "ControllerHaConfig",
    "Config",
    "load_config",
    "decode_config",
    "validate_config",
    "hash_api_key",
    "render_markdown",
]


# --------------------------------------------------------------------------------------------
# Shared vocabularies and constraints

#: Request priorities, lowest first: the order in which load is shed.
Priority = Literal["batch", "default", "interactive"]
PRIORITIES: tuple[str, ...] = typing.get_args(Priority)

#: Routing policies (``fastroute.policy``); ``prefix-hrw`` (the default) and ``weighted-hrw``
#: follow the controller's LP weights.
#: The one list of their names: ``fastroute.policy.registry`` checks at import it has a policy
#: for each, and no other.
PolicyName = Literal[
    "prefix-hrw",
    "weighted-hrw",
    "round-robin",
    "least-request",
    "power-of-two",
    "consistent-hash",
    "cache-aware",
    "marginal-cost",
    "length-heuristic",
]
POLICY_NAMES: tuple[str, ...] = typing.get_args(PolicyName)
#: The policy of a class that names none (``PolicyConfig.default``).
DEFAULT_POLICY_NAME = "prefix-hrw"

#: Engine roles: ``both`` serves whole requests; ``prefill``/``decode`` form P/D pools.
Role = Literal["both", "prefill", "decode"]
EngineKind = Literal["vllm", "sglang", "llamacpp", "openai"]
#: How a P/D model's requests reach its engines: ``nixl`` = vLLM's sequential
#: ``kv_transfer_params`` steps, ``bootstrap`` = SGLang's concurrent dispatch with a
#: shared ``bootstrap_room``.
PDProtocol = Literal["nixl", "bootstrap"]
#: SGLang's default ``--disaggregation-bootstrap-port`` of a prefill server.
DEFAULT_BOOTSTRAP_PORT = 8998

#: Default slots of the shared stats block (``proxy.max_engines``): engines added at run
#: time (admin API, discovery) get a slot while there is one.
DEFAULT_MAX_ENGINES = 256
#: Upper bound of ``proxy.max_engines`` (64 bytes a slot: 4 MiB).
MAX_STATS_ENGINES = 65536
#: Default re-resolution interval of a ``[[discovery]]`` name, seconds.
DEFAULT_DISCOVERY_INTERVAL_S = 10.0
#: Default timeout of one DNS resolution, seconds.
DEFAULT_DISCOVERY_TIMEOUT_S = 2.0
#: Record types a ``[[discovery]]`` section resolves: ``A`` (A and AAAA, with ``port``) or
#: ``SRV`` (host and port from the record).
DiscoveryRecord = Literal["A", "SRV"]

#: The built-in hardware profiles' names (:data:`fastroute.hardware.PROFILES`).
DEFAULT_HARDWARE_CLASSES: tuple[str, ...] = tuple(PROFILES)

DEFAULT_REGION = "local"
DEFAULT_ZONE = "default"

#: Identifiers: engine, region, zone, tenant, class and hardware names.
Name = Annotated[
    str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
]
#: A path the proxy may pass through to engines: ``/v1/...``, exact, or a prefix ending in ``/``.
PassthroughPath = Annotated[
    str, msgspec.Meta(min_length=4, max_length=256, pattern=r"^/v1/[A-Za-z0-9._~/-]*$")
]
#: A served model name as clients send it (no whitespace, no ``*``).
ModelName = Annotated[str, msgspec.Meta(min_length=1, max_length=256, pattern=r"^[^\s*]+$")]
#: A model name in a class: a served model name, or ``*`` for every model.
ModelPattern = Annotated[str, msgspec.Meta(min_length=1, max_length=256, pattern=r"^(\*|[^\s*]+)$")]
HeaderName = Annotated[
    str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9-]*$")
]
#: A shared-memory segment name (a file under ``/dev/shm``).
SegmentName = Annotated[
    str, msgspec.Meta(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
]
Host = Annotated[str, msgspec.Meta(min_length=1, max_length=253, pattern=r"^[^\s/]+$")]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
PositiveSeconds = Annotated[float, msgspec.Meta(gt=0, le=86400)]
Fraction = Annotated[float, msgspec.Meta(gt=0, le=1)]
Sha256Hex = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
ApiKey = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
HttpStatus = Annotated[int, msgspec.Meta(ge=400, le=599)]

_STRUCT_OPTIONS: dict[str, Any] = {"frozen": True, "kw_only": True, "forbid_unknown_fields": True}


class _Section(msgspec.Struct, **_STRUCT_OPTIONS):
    """Base of every config Struct: frozen, keyword-only, unknown keys rejected."""


# --------------------------------------------------------------------------------------------
# Network


class RegionConfig(_Section):
    """A region (cluster): where engines run and where data planes take traffic from.

    Attributes
    ----------
    name : str
        Region name, unique; engines, ``proxy.cluster`` and the RTT matrix refer to it.
    zone : str
        The data-residency zone the region belongs to. Tenants are allowed zones, and
        a request only goes to engines in its allowed zones.
    """

    name: Name
    zone: Name = DEFAULT_ZONE


class NetworkConfig(_Section):
    """Regions and the region×region round-trip-time matrix the controller's LP uses.

    Attributes
    ----------
    regions : array of tables
        The declared regions, each a ``[[network.regions]]`` table. The default is a
        single region ``local`` in zone ``default``.
    rtt_ms : table
        Round-trip time in milliseconds from a source region (the data plane's
        cluster) to an engine region: ``[network.rtt_ms]`` then
        ``us-east = { eu-west = 80.0 }``. A missing direction takes the reverse
        direction's value, a missing diagonal is 0; every other pair of declared
        regions must be given. Values must be finite and >= 0.
    """

    regions: Annotated[tuple[RegionConfig, ...], msgspec.Meta(min_length=1)] = (
        RegionConfig(name=DEFAULT_REGION),
    )
    rtt_ms: dict[str, dict[str, float]] = {}

    def region(self, name: str) -> RegionConfig:
        """Return the region called ``name``; raise ``KeyError`` if it is not declared."""
        for region in self.regions:
            if region.name == name:
                return region
        raise KeyError(f"unknown region {name!r}; declared: {[r.name for r in self.regions]}")

    def rtt(self, src: str, dst: str) -> float:
        """Return the RTT in ms from region ``src`` to region ``dst`` with the defaults applied.

        Raises ``KeyError`` if the pair is not covered (a validated config covers all).
        """
        row = self.rtt_ms.get(src, {})
        if dst in row:
            return row[dst]
        back = self.rtt_ms.get(dst, {})
        if src in back:
            return back[src]
        if src == dst:
            return 0.0
        raise KeyError(f"no RTT given between regions {src!r} and {dst!r}")

    def rtt_matrix_ms(self) -> tuple[tuple[float, ...], ...]:
        """Return the full RTT matrix in ms, rows and columns in ``regions`` order."""
        names = [r.name for r in self.regions]
        return tuple(tuple(self.rtt(a, b) for b in names) for a in names)


# --------------------------------------------------------------------------------------------
# Fleet: engines, tenants, classes


class EngineConfig(_Section):
    """One inference engine (vLLM, SGLang, the emulator): an ``[[engines]]`` table.

    Attributes
    ----------
    name : str
        Engine name, unique. Its stable 64-bit id in the weight table is
        ``fastroute.hashing.engine_id(name)``, so renaming an engine moves its sessions.
    url : str
        Server root, ``http://host:port`` or ``https://host:port``: explicit port, no
        path (fastroute appends ``/v1/...``, ``/metrics`` and ``/health``).
    models : array of strings
        Model names the engine serves, exactly as clients send them; at least one.
    region : str
        The region the engine runs in; must be declared in ``[[network.regions]]``.
    zone : str, optional
        Residency zone; defaults to the region's zone. If given, it must be the zone
        of some declared region.
    hardware : str
        Hardware class (profile) label; must be one of ``hardware_classes``. Engines
        with the same hardware, model and region form one group in the LP.
    role : {"both", "prefill", "decode"}
        ``both`` serves whole requests; ``prefill`` and ``decode`` engines form a
        disaggregated pair. The pair's protocol follows ``kind``: ``sglang`` engines use
        SGLang's bootstrap protocol (both engines get the request at once, with a shared
        ``bootstrap_room``), the others vLLM's ``kv_transfer_params``. A model's prefill
        and decode engines must agree (all ``sglang`` or none).
    capacity_rps : float
        Nominal capacity in requests per second at the typical request mix: the
        weight of capacity-proportional fallback routing and the controller's prior
        until profiles are fitted. Only ratios between engines matter for fallback,
        and for the default policy's cost spill, which reads them as the engines'
        relative prefill speeds (equal capacities: engines alike).
    max_concurrency : int, optional
        Cap on requests in flight to this engine from one proxy worker; unset means
        no proxy-side cap (the engine's own queue and 429s apply).
    api_key : str, optional
        Bearer token the proxy sends to this engine (engines behind their own auth).
    kind : {"vllm", "sglang", "llamacpp", "openai"}
        The engine's software, so its ``/metrics`` dialect: ``vllm`` (also the emulator's
        default), ``sglang`` (``sglang:*``, started with ``--enable-metrics``), ``llamacpp``
        (``llamacpp:*``, started with ``--metrics``), or ``openai``: any OpenAI-compatible
        server, no metrics scraped.
    bootstrap_port : int, optional
        ``kind = "sglang"``, ``role = "prefill"`` only: the engine's disaggregation
        bootstrap port (``--disaggregation-bootstrap-port``), sent to the decode engine
        as ``bootstrap_port``; unset means SGLang's default, 8998.
    """

    name: Name
    url: Annotated[str, msgspec.Meta(min_length=1, max_length=2048)]
    models: Annotated[tuple[ModelName, ...], msgspec.Meta(min_length=1)]
    region: Name = DEFAULT_REGION
    zone: Name | None = None
    hardware: Name = "a40"
    role: Role = "both"
    capacity_rps: Annotated[float, msgspec.Meta(gt=0, le=1e9)] = 10.0
    max_concurrency: Annotated[int, msgspec.Meta(ge=1)] | None = None
    api_key: ApiKey | None = None
    kind: EngineKind = "vllm"
    bootstrap_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] | None = None


class DiscoveryConfig(_Section):
    """Engines found in DNS: a ``[[discovery]]`` table, one model's engines behind one name.

    Every address the name resolves to is an engine, named ``{name}/{host}:{port}``, with
    the engine fields below; the name is re-resolved every ``interval_s``. Engines that
    disappear are drained (requests in flight finish); a failed resolution keeps the last
    set (logged, counted). One process per host resolves (the ``fastroute serve``
    supervisor) and shares the result through the engines state file.

    Attributes
    ----------
    name : str
        Name of this discovery, unique; the prefix of its engines' names.
    dns_name : str
        The DNS name to resolve, e.g. a Kubernetes headless service
        ``vllm.inference.svc.cluster.local`` (or ``_http._tcp.vllm...`` for SRV).
    models : array of strings
        Model names the discovered engines serve; at least one.
    record : {"A", "SRV"}
        ``A``: the A and AAAA records, each an engine on ``port``; ``SRV``: each SRV
        record's target and port.
    port : int, optional
        The engines' port for ``record = "A"`` (required there; SRV records carry theirs).
    scheme : {"http", "https"}
        URL scheme of the engines.
    nameserver : str, optional
        ``host:port`` of the DNS server to ask (e.g. ``"127.0.0.1:5353"``), over UDP.
        Unset: the system resolver for A/AAAA, the first ``nameserver`` of
        ``/etc/resolv.conf`` for SRV.
    interval_s : float
        Re-resolution interval, seconds.
    timeout_s : float
        Timeout of one resolution, seconds; less than ``interval_s``.
    region : str
        Region of the discovered engines; must be declared in ``[[network.regions]]``.
    zone : str, optional
        Residency zone; defaults to the region's zone.
    hardware : str
        Hardware class of the discovered engines; one of ``hardware_classes``.
    role : {"both", "prefill", "decode"}
        Role of the discovered engines.
    capacity_rps : float
        Nominal capacity of each discovered engine, requests per second.
    max_concurrency : int, optional
        Per-worker cap on requests in flight to each discovered engine.
    api_key : str, optional
        Bearer token the proxy sends to the discovered engines.
    kind : {"vllm", "sglang", "llamacpp", "openai"}
        The discovered engines' software (their ``/metrics`` dialect).
    """

    name: Name
    dns_name: Host
    models: Annotated[tuple[ModelName, ...], msgspec.Meta(min_length=1)]
    record: DiscoveryRecord = "A"
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)] | None = None
    scheme: Literal["http", "https"] = "http"
    nameserver: Annotated[str, msgspec.Meta(pattern=r"^[^\s/]+:[0-9]{1,5}$")] | None = None
    interval_s: PositiveSeconds = DEFAULT_DISCOVERY_INTERVAL_S
    timeout_s: PositiveSeconds = DEFAULT_DISCOVERY_TIMEOUT_S
    region: Name = DEFAULT_REGION
    zone: Name | None = None
    hardware: Name = "a40"
    role: Role = "both"
    capacity_rps: Annotated[float, msgspec.Meta(gt=0, le=1e9)] = 10.0
    max_concurrency: Annotated[int, msgspec.Meta(ge=1)] | None = None
    api_key: ApiKey | None = None
    kind: EngineKind = "vllm"


def bootstrap_port_of(engine: EngineConfig) -> int:
    """The bootstrap port a decode engine reaches ``engine`` (an SGLang prefill engine) on."""
    return DEFAULT_BOOTSTRAP_PORT if engine.bootstrap_port is None else engine.bootstrap_port


def pd_protocol_of(kinds: Iterable[str]) -> PDProtocol:
    """The P/D protocol of a model whose prefill and decode engines are of ``kinds``
    (which :func:`validate_config` has checked agree): ``bootstrap`` for SGLang."""
    return "bootstrap" if "sglang" in set(kinds) else "nixl"


class TenantConfig(_Section):
    """A tenant: who may send requests, and where their data may be processed.

    Attributes
    ----------
    name : str
        Tenant name, unique.
    api_keys : array of strings
        API keys (``Authorization: Bearer <key>``) that identify the tenant, in clear
        text. Prefer ``api_key_sha256`` so the file holds no secrets.
    api_key_sha256 : array of strings
        SHA-256 hex digests (64 lowercase hex digits) of API keys;
        ``fastroute.config.hash_api_key(key)`` computes one. A key may identify only
        one tenant.
    zones : array of strings
        Residency zones the tenant's requests may be served in; each must be a
        declared region's zone. Empty means every zone. A request header
        (``proxy.zone_header``) may narrow this set, never widen it.
    default_priority : {"batch", "default", "interactive"}
        Priority of the tenant's requests when they carry no priority header.
    hardware : str, optional
        Restrict the tenant to engines of this hardware class (one of
        ``hardware_classes``); unset means any hardware.
    requests_per_min : int, optional
        Fleet-wide request limit, requests per minute (1 to 10^8). Each proxy
        enforces its share (the controller's split by demand, else the limit divided by
        ``proxy.proxy_count``) with a token bucket shared by its workers; the bucket
        holds at most one minute's share, so a tenant idle for a minute may burst that
        much and no more. Unset: unlimited.
    tokens_per_min : int, optional
        Fleet-wide prompt + output token limit per minute (1 to 10^11), charged at
        admission from the prompt estimate and ``max_tokens`` and corrected by the
        engine's usage when the request ends. Unset: unlimited.
    max_concurrent : int, optional
        Fleet-wide limit on the tenant's requests in flight (1 to 10^6), split among
        the proxies like the rates (each proxy gets at least one). Unset: unlimited.
    weight : float
        The tenant's share of its priority when the controller sheds (weighted max-min
        over demand, 0.01 to 1000): with weights 2 and 1, both over their share, the
        first is admitted twice as much. Default 1 (equal shares).
    """

    name: Name
    api_keys: tuple[ApiKey, ...] = ()
    api_key_sha256: tuple[Sha256Hex, ...] = ()
    zones: tuple[Name, ...] = ()
    default_priority: Priority = "default"
    hardware: Name | None = None
    requests_per_min: Annotated[int, msgspec.Meta(ge=1, le=10**8)] | None = None
    tokens_per_min: Annotated[int, msgspec.Meta(ge=1, le=10**11)] | None = None
    max_concurrent: Annotated[int, msgspec.Meta(ge=1, le=10**6)] | None = None
    weight: Annotated[float, msgspec.Meta(ge=0.01, le=1000)] = 1.0


class ClassConfig(_Section):
    """A request class: the SLOs and policy of requests for one model at one priority.

    A request is matched to the class with its model and priority; failing that, to the
    class with model ``*`` and its priority; failing that, it gets these defaults
    (see ``Config.class_for``).

    Attributes
    ----------
    name : str
        Class name, unique; used in metrics and the controller's plan.
    model : str
        The model the class covers, or ``*`` for every model without a class of its
        own. A named model must be served by at least one engine.
    priority : {"batch", "default", "interactive"}
        Priority; the LP sheds ``batch`` before ``default`` before ``interactive``.
        Each (model, priority) pair may have one class.
    ttft_slo_s : float
        Time-to-first-token objective, seconds. It bounds the usable utilisation in
        the controller's profiles, and the admission target defaults to 10 % of it.
    tbot_slo_s : float
        Time-between-output-tokens objective, seconds.
    policy : str, optional
        Routing policy for this class, one of the names of ``policy.default``; unset
        means ``policy.default``.
    migrate : bool
        A stream whose engine fails after tokens reached the client continues on the
        next ranked engine (``retry.max_migrations``; docs/failure-handling.md); false
        ends it with an SSE error event instead.
    hedge : bool
        Hedged first tokens (docs/failure-handling.md, "Hedged first tokens"): a stream
        whose first token has not arrived after the hedge delay is also sent to the
        runner-up engine; the first to produce a token is relayed, the other cancelled.
        Off by default: a hedge pays one extra prefill, worth it only for TTFT-critical
        classes.
    hedge_floor_s : float, optional
        The class's lower bound on the hedge delay, seconds; unset means
        ``retry.hedge_floor_s``.
    """

    name: Name
    model: ModelPattern
    priority: Priority = "default"
    ttft_slo_s: PositiveSeconds = 2.0
    tbot_slo_s: PositiveSeconds = 0.1
    policy: PolicyName | None = None
    migrate: bool = True
    hedge: bool = False
    hedge_floor_s: PositiveSeconds | None = None


# --------------------------------------------------------------------------------------------
# Data-plane behaviour


class PolicyConfig(_Section):
    """Engine selection among the eligible engines (docs/design.md §3 steps 5–6).

    Attributes
    ----------
    default : str
        Policy for classes without their own: ``prefix-hrw`` (rendezvous homes of the
        prompt's prefix depths over the controller's LP weights, the shallowest home within
        its bounded share of queued prompt tokens), ``weighted-hrw`` (weighted rendezvous
        hashing of the routing key over the LP weights), ``round-robin``, ``least-request``,
        ``power-of-two``, ``consistent-hash``, ``cache-aware``, ``marginal-cost`` or
        ``length-heuristic`` (long prompts by in-flight prompt tokens, short ones by count).
    top_k : int
        Length of the candidate ranking the pick returns: failover order for the retry
        and the candidate set of the marginal-cost refinement.
    bounded_load : bool
        ``weighted-hrw`` only: walk down the ranking past engines whose in-flight count
        exceeds ``bounded_load_factor`` times the mean (a hot-key guard). ``prefix-hrw``
        has its own bound (``[policy.params.prefix-hrw] balance_factor``).
    bounded_load_factor : float
        The bounded-load factor c (>= 1). Loose values (about 2) keep KV-cache
        locality at normal load and only act under hot keys.
    params : table
        Tunables per policy, passed as keyword arguments to
        ``fastroute.policy.make_policy``, which rejects unknown ones:
        ``[policy.params.cache-aware]`` then ``cache_threshold = 0.5``. Keys must be
        policy names; values are booleans, integers, floats or strings.
    """

    default: PolicyName = DEFAULT_POLICY_NAME  # type: ignore[assignment]
    top_k: Annotated[int, msgspec.Meta(ge=1, le=64)] = 3
    bounded_load: bool = True
    bounded_load_factor: Annotated[float, msgspec.Meta(ge=1.0, le=1e6)] = 2.0
    params: dict[str, dict[str, bool | int | float | str]] = {}


#: Highest ``retry.max_migrations``: each migration re-sends the prompt and the text so far.
MAX_MIGRATIONS_BOUND = 4


class RetryConfig(_Section):
    """Retry budget (Finagle-style token bucket; docs/algorithms.md §3).

    Retries happen only before the first byte reaches the client, to the next
    candidate of the ranking, never to the same engine; after it, a failed stream may
    be migrated (``max_migrations``).

    Attributes
    ----------
    ratio : float
        Retries allowed per original request over ``ttl_s`` (0.1 bounds load
        amplification to 1.1; 0 leaves only the ``min_retries_per_s`` floor). The
        controller may publish a lower ratio.
    min_retries_per_s : float
        Floor so low-traffic proxies can still retry: this many retries per second
        are always allowed.
    ttl_s : float
        How long deposits and withdrawals count, seconds.
    max_retries : int
        Retries per request: 0 disables retries; at most 1 (docs/design.md §3).
    retry_on_status : array of integers
        Upstream HTTP statuses (received before any byte went to the client) that may
        be retried; connection failures and timeouts before the first byte always may.
    max_migrations : int
        Mid-stream migrations per request: a chat or completions stream whose engine
        fails after tokens reached the client continues on the next ranked engine
        (docs/failure-handling.md). Each one after a failure also takes a retry from
        the budget (a drain hand-off does not); 0 disables migration and hand-offs.
    max_migration_text_bytes : int
        Most bytes of a stream the proxy keeps to continue it elsewhere; a longer
        stream that breaks is not migrated (it ends with an SSE error event).
    drain_handoff_after_s : float
        A stream relaying from an engine that starts draining (drained through the
        admin API, removed from the config, flagged draining or unavailable in the
        weight table) is handed off to the next ranked engine this many seconds after
        the proxy saw the drain, by the same migration (within ``max_migrations``; not
        from the retry budget: it is planned work, not a failure). Streams that end
        within it stay where they are (a hand-off costs the new engine a prefill of the
        prompt and the text so far); 5 s covers a median chat answer (a few hundred
        tokens at 30–100 tokens/s per stream), so only the long streams that would hold
        a rollout for minutes move. 0 hands off at the next chunk; a negative value
        (-1) never hands off (streams finish on the draining engine).
    hedge_quantile : float
        Classes with ``hedge = true``: the hedge delay is this quantile of the class's
        recent first-token times (the conformal bound of the last ``hedge_window``).
        A hedge fires only on requests slower than this quantile, so about
        ``1 − hedge_quantile`` of them (5 % at 0.95) pay an extra prefill.
    hedge_floor_s : float
        Lower bound on the hedge delay, seconds: below a few engine steps (a decode
        step is 10–30 ms, a batch's prefill more) a late first token is batching noise,
        not a slow engine, and a hedge would only double the prefill.
    hedge_window : int
        First-token times kept per hedged class for its delay (the most recent): 512
        leaves about 25 above the p95, enough for a stable quantile, and at tens of
        requests per second covers the last tens of seconds, so the delay follows load.
    hedge_min_samples : int
        Below this many first-token times the delay is the class's ``ttft_slo_s``
        (the tail the operator named), bounded below by the floor.
    """

    ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.1
    min_retries_per_s: Annotated[float, msgspec.Meta(ge=0, le=1e6)] = 2.0
    ttl_s: PositiveSeconds = 10.0
    max_retries: Annotated[int, msgspec.Meta(ge=0, le=1)] = 1
    retry_on_status: tuple[HttpStatus, ...] = (429, 500, 502, 503, 504)
    max_migrations: Annotated[int, msgspec.Meta(ge=0, le=MAX_MIGRATIONS_BOUND)] = 1
    max_migration_text_bytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 30)] = 1 << 20
    drain_handoff_after_s: Annotated[float, msgspec.Meta(ge=-1, le=86400)] = 5.0
    hedge_quantile: Annotated[float, msgspec.Meta(gt=0.5, lt=1.0)] = 0.95
    hedge_floor_s: Annotated[float, msgspec.Meta(ge=0.001, le=600.0)] = 0.05
    hedge_window: Annotated[int, msgspec.Meta(ge=16, le=65536)] = 512
    hedge_min_samples: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 20


class EjectionConfig(_Section):
    """Fast local outlier ejection (Envoy consecutive-failure semantics; docs/algorithms.md §4).

    Attributes
    ----------
    consecutive_failures : int
        Consecutive failures (connect errors, 5xx, timeouts) that eject an engine.
    base_ejection_s : float
        First ejection length, seconds; the k-th ejection lasts ``base × 2**(k − 1)``.
    max_ejection_s : float
        Cap on an ejection's length, seconds; at least ``base_ejection_s``.
    max_ejected_fraction : float
        At most this fraction of a class's eligible engines is ejected at once; beyond
        it failing engines stay in rotation (ejecting everything helps nobody).
    """

    consecutive_failures: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 5
    base_ejection_s: PositiveSeconds = 30.0
    max_ejection_s: PositiveSeconds = 300.0
    max_ejected_fraction: Fraction = 0.5


class AdmissionConfig(_Section):
    """Local, reactive admission: CoDel-style queue-delay guard (docs/algorithms.md §5).

    Attributes
    ----------
    enabled : bool
        Apply the queue-delay guard (the controller's shed fractions apply regardless).
    target_sojourn_s : float, optional
        CoDel target: the minimum queueing delay over an interval above which new
        sessions are rejected (lowest priority first). Unset means 10 % of the class's
        ``ttft_slo_s``.
    interval_s : float
        CoDel interval, seconds: how long the minimum delay must stay above target.
    max_queue_len : int
        Requests waiting for admission per worker; when full, new requests get 429.
    max_wait_s : float
        Longest a request may wait for admission, seconds; then it gets 429.
    retry_after_s : int
        Value of the ``Retry-After`` header on 429 responses, whole seconds.
    """

    enabled: bool = True
    target_sojourn_s: PositiveSeconds | None = None
    interval_s: PositiveSeconds = 0.5
    max_queue_len: Annotated[int, msgspec.Meta(ge=1, le=10_000_000)] = 256
    max_wait_s: PositiveSeconds = 5.0
    retry_after_s: Annotated[int, msgspec.Meta(ge=1, le=3600)] = 1


class TimeoutsConfig(_Section):
    """Upstream timeouts of the proxy, per attempt.

    Attributes
    ----------
    connect_timeout_s : float
        TCP (and TLS) connect to an engine, seconds.
    first_byte_timeout_s : float
        From sending the request to the engine's response headers, seconds (includes
        engine queueing and prefill).
    idle_timeout_s : float
        Longest silence between two streamed chunks, seconds; then the stream is
        closed with an SSE error event.
    total_timeout_s : float
        Whole request, seconds; bounds every other timeout.
    """

    connect_timeout_s: PositiveSeconds = 2.0
    first_byte_timeout_s: PositiveSeconds = 60.0
    idle_timeout_s: PositiveSeconds = 30.0
    total_timeout_s: PositiveSeconds = 600.0


class LimitsConfig(_Section):
    """Resource limits of the proxy.

    Attributes
    ----------
    max_body_bytes : int
        Largest request body, bytes; larger bodies get 413.
    max_audio_body_bytes : int
        Largest multipart body of ``/v1/audio/transcriptions`` and ``/v1/audio/translations``,
        bytes (they are not held to ``max_body_bytes``); larger bodies get 413
        ``request_too_large``. The default leaves room for vLLM's 25 MB audio file limit plus
        the form's other fields.
    max_concurrent_requests : int
        Requests in flight per proxy worker process; beyond it requests queue for
        admission (``admission.max_queue_len``).
    header_timeout_s : float
        Longest a client may take to send one request's line and headers, seconds, once
        its first byte arrived; past it the connection is closed (slowloris). A client
        sends a head of a few KB in one write, well under a round trip; 10 s is above any
        real link's RTT and holds a trickling connection 10-15 s (the server checks every
        ``header_timeout_s / 2``) instead of the 75 s keep-alive bound.
    write_stall_timeout_s : float
        Longest the proxy's write buffer to a client may stay full (the client reads
        nothing), seconds; past it the connection is dropped and its request cancelled
        (the engine stream is closed). A client that reads drains its socket in well under
        a second; the default equals ``timeouts.idle_timeout_s``, the bound an engine gets
        for the same silence.
    """

    max_body_bytes: Annotated[int, msgspec.Meta(ge=1024, le=1 << 30)] = 8 * 1024 * 1024
    max_audio_body_bytes: Annotated[int, msgspec.Meta(ge=1024, le=1 << 30)] = 32 * 1024 * 1024
    max_concurrent_requests: Annotated[int, msgspec.Meta(ge=1, le=10_000_000)] = 4096
    header_timeout_s: Annotated[float, msgspec.Meta(ge=0.1, le=600.0)] = 10.0
    write_stall_timeout_s: Annotated[float, msgspec.Meta(ge=0.1, le=3600.0)] = 30.0


class ProxyConfig(_Section):
    """The data plane process (``fastroute serve``).

    Attributes
    ----------
    host : str
        Listen address.
    port : int
        Listen port; 0 picks a free port (tests).
    workers : int
        Worker processes sharing the port (``SO_REUSEPORT``) and one weight table.
    cluster : str
        The region this data plane takes traffic in (its source cluster): selects the
        weight-table rows and the RTT row. Must be a declared region.
    session_header : str
        Request header carrying an explicit session id, the preferred routing key.
    priority_header : str
        Request header that may set the priority (batch, default, interactive).
    zone_header : str
        Request header that may narrow the tenant's residency zones
        (comma-separated zone names).
    default_tenant : str, optional
        Tenant of requests whose API key matches no tenant (or that carry none); must
        be a declared tenant. Unset means such requests get 401, unless no tenants are
        declared at all (then every request is anonymous).
    admin_token : str, optional
        Bearer token that opens the admin endpoints (decision records) to clients off the
        host; loopback clients need none. Unset: loopback only.
    forward_authorization : bool
        Forward the client's ``Authorization`` header to engines (otherwise the
        engine's ``api_key``, if any, is sent).
    table_name : str
        Shared-memory weight table (a file under ``/dev/shm``); on the controller's
        host the controller writes it.
    stats_name : str
        Shared-memory per-engine stats block the workers write.
    response_map_capacity : int
        Entries of the host's stored-response id → engine map (``{stats_name}.responses``,
        24 bytes each, a multiple of 8): a Responses follow-up (``previous_response_id``,
        ``GET /v1/responses/{id}``) goes to the engine that stored the response. When
        full, the oldest entries of a bucket are overwritten.
    key_log_entries : int
        Entries of the host's key log (``{stats_name}.keys``, 536 bytes each; 0 or a power
        of two from 16 to 1,048,576; default 4096, about 2.2 MB): the prefix keys each
        worker routes, its whole prompt key and the engine each request went to, read by
        the others, so that every worker's ``prefix-hrw`` tables (hot groups, seen prefixes
        and where they went, repeated prompts) count the host's traffic, not a
        ``1/workers`` sample of
        it (:mod:`fastroute.tables.key_log`). A worker more than this many of the host's
        requests behind skips the oldest, and a worker that starts or reloads replays
        that many; 4096 is four of the tables' 1024-request half-lives, beyond which an
        entry counts less than 1/16. 0: each worker counts its own requests only.
    controller_url : str, optional
        ``http://host:port`` of a controller on another host: the proxy pulls weight
        snapshots from it and reports to it. Unset means the controller shares this
        host's ``table_name``, and the proxy reports its demand to the ``[controller]``
        section's host and port (none when that port is 0).
    controller_fallback_urls : array of str
        More controllers (several on etcd, docs/operations.md "Running several
        controllers"), tried in order for the table after ``controller_url`` fails to
        answer (connection error, timeout, HTTP error); any of them redirects to the leader.
        Reports still go to ``controller_url`` (a follower relays them to the leader).
    etcd_urls : array of str
        Client URLs of the controllers' etcd (``http://host:2379``): the weights puller reads
        the leader's ``advertise_url`` from ``leader_key`` and pulls from it, falling back to
        ``controller_url`` and ``controller_fallback_urls`` while etcd does not answer or names
        no leader. Needs ``controller_url`` (reports go there). Empty: no etcd lookup.
    leader_key : str, optional
        The etcd key the leading controller writes its URL at; default (unset) the
        ``[controller.ha]`` section's ``election_key``, the same key when the proxy shares the
        controllers' config file.
    etcd_timeout_s : float
        Timeout of one etcd read on one member, seconds (a lookup tries each member in turn).
    stale_table_max_age_s : float
        The start rule (docs/operations.md "Stale tables at proxy start"): a weight table found
        at start whose writer is gone (nobody holds its lock) steers requests only if it is at
        most this old and the proxy has no ``controller_url`` to confirm it with; otherwise the
        proxy routes on capacity weights until a live writer publishes (``/ready`` says so).
        Default 60 s: a live controller republishes an unchanged table every
        ``republish_after_s`` (10 periods, 50 s by default), and a successor takes over within
        the lease TTL (10 s), so an older table was in force after its deployment's
        controllers stopped.
    report_interval_s : float
        How often the proxy reports demand and in-band signals to the controller.
    scrape_engines : bool
        The proxy scrapes engine ``/metrics`` itself (normally the controller does).
    scrape_interval_s : float
        Interval of the proxy's own engine scrapes, seconds.
    scrape_timeout_s : float
        Timeout of one engine scrape, seconds; less than ``scrape_interval_s``.
    drain_timeout_s : float
        On SIGTERM or reload, how long in-flight requests may finish, seconds.
    max_engines : int
        Slots of the shared stats block, created at start: the configured engines plus
        headroom for engines added later (admin API, DNS discovery). An engine beyond
        it still routes, with per-worker instead of shared counters (logged).
    passthrough_paths : array of strings
        ``POST`` paths under ``/v1/`` the proxy has no route of its own for but passes
        through to an engine of the body's ``model`` (least-loaded): exact paths, or prefixes
        ending in ``/``. Empty (the default): such paths get 404.
    models_scrape_interval_s : float
        How often each worker asks every engine's ``GET /v1/models`` (what ``GET /v1/models``
        and ``/ready`` report), seconds.
    peers : array of str
        ``http(s)://host:port`` of the deployment's *other* proxies (one per host). One
        worker per host polls their ``GET /admin/queue`` every ``peer_poll_interval_s`` and
        every worker adds the prompt tokens they have queued on each engine to its host's
        (:mod:`fastroute.proxy.background.peer_queues`): load-aware policies (``prefix-hrw``)
        then see every proxy's queue, not only their own host's share of it. Sends
        ``admin_token`` as a bearer token (the peers' admin rule: loopback or that token).
        Empty (the default): each proxy sees its own host's queue only. At most 64.
    peer_poll_interval_s : float
        Period of each peer's polls, seconds; default 0.05. A queued prompt waits about
        one prefill (0.1-2 s), so a view older than a fraction of the shortest one
        misleads: in the simulator (24 seeds, 4 workers x 2 proxies against 1 x 1, the
        worst family at 90 % load) 0.25 s cost 2.5 % of goodput, 0.1 s 1.9 %, 0.05 s
        1.4 %; each poll costs about 0.5 ms of CPU on each side (about 2 % of a core per
        peer at 0.05 s, ``bench/bench_peer_poll_cost.py``; docs/fleet-benchmark.md
        "Several proxies"). Each peer is polled on its own cadence; one that has not
        answered within 0.8 of the period (at least 1 s: a peer in another region) counts
        as 0 until it answers.
    peer_key_exchange : bool
        The peer polls also carry prefix keys (default true): each answer adds the peer's
        own key-log entries since the last poll, and the poller appends them into its
        host's key log, so every proxy's ``prefix-hrw`` tables count the whole
        deployment's requests, not the ``1/proxies`` share routed here
        (:mod:`fastroute.policy.key_exchange`; at most 1024 entries a peer per poll). Needs
        ``peers`` and ``key_log_entries > 0``; false: queues only.
    proxy_count : int
        Proxies (hosts) that share the tenants' fleet-wide limits when no controller
        divides them (or before its first table): each proxy enforces the limit divided
        by this count (1 to 4096). Default 1: a single proxy enforces the whole limit,
        the safe reading for a lone proxy; set it to the number of proxies otherwise.
    """

    host: Host = "127.0.0.1"
    port: Port = 8080
    workers: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    cluster: Name = DEFAULT_REGION
    session_header: HeaderName = "x-session-id"
    priority_header: HeaderName = "x-fastroute-priority"
    zone_header: HeaderName = "x-fastroute-zone"
    default_tenant: Name | None = None
    admin_token: Annotated[str, msgspec.Meta(min_length=16, max_length=512)] | None = None
    forward_authorization: bool = False
    table_name: SegmentName = "fastroute-weights"
    stats_name: SegmentName = "fastroute-stats"
    response_map_capacity: Annotated[int, msgspec.Meta(ge=8, le=1 << 24, multiple_of=8)] = 65536
    key_log_entries: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 4096
    controller_url: Annotated[str, msgspec.Meta(min_length=1, max_length=2048)] | None = None
    controller_fallback_urls: Annotated[
        tuple[Annotated[str, msgspec.Meta(min_length=1, max_length=2048)], ...],
        msgspec.Meta(max_length=16),
    ] = ()
    etcd_urls: Annotated[tuple[str, ...], msgspec.Meta(max_length=16)] = ()
    leader_key: (
        Annotated[str, msgspec.Meta(min_length=2, max_length=512, pattern=r"^/[A-Za-z0-9._/-]+$")]
        | None
    ) = None
    etcd_timeout_s: PositiveSeconds = 0.5
    stale_table_max_age_s: PositiveSeconds = 60.0
    report_interval_s: PositiveSeconds = 1.0
    scrape_engines: bool = False
    scrape_interval_s: PositiveSeconds = 1.0
    scrape_timeout_s: PositiveSeconds = 0.5
    drain_timeout_s: PositiveSeconds = 30.0
    max_engines: Annotated[int, msgspec.Meta(ge=1, le=MAX_STATS_ENGINES)] = DEFAULT_MAX_ENGINES
    passthrough_paths: Annotated[tuple[PassthroughPath, ...], msgspec.Meta(max_length=256)] = ()
    models_scrape_interval_s: PositiveSeconds = 15.0
    peers: Annotated[
        tuple[Annotated[str, msgspec.Meta(min_length=1, max_length=2048)], ...],
        msgspec.Meta(max_length=64),
    ] = ()
    peer_poll_interval_s: Annotated[float, msgspec.Meta(ge=0.01, le=60)] = 0.05
    peer_key_exchange: bool = True
    proxy_count: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1

    def __post_init__(self) -> None:
        entries = self.key_log_entries
        if entries and (entries < 16 or entries & (entries - 1)):
            raise ValueError(
                f"proxy.key_log_entries must be 0 or a power of two from 16 to 1048576, "
                f"got {entries}"
            )
        for url in self.etcd_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"proxy.etcd_urls: {url!r} must start with http://")
        if self.etcd_urls and not self.controller_url:
            raise ValueError(
                "proxy.etcd_urls needs proxy.controller_url (the fallback while etcd does not "
                "answer, and where reports go)"
            )


# --------------------------------------------------------------------------------------------
# Controller


class ShedPenaltiesConfig(_Section):
    """Per-priority multipliers π of the LP's shed penalty P = π · P₀ (docs/algorithms.md §1.3).

    Attributes
    ----------
    batch : float
        Multiplier for ``batch`` demand.
    default : float
        Multiplier for ``default`` demand; at least ``batch``.
    interactive : float
        Multiplier for ``interactive`` demand; at least ``default``.
    """

    batch: Annotated[float, msgspec.Meta(gt=0, le=1e9)] = 1.0
    default: Annotated[float, msgspec.Meta(gt=0, le=1e9)] = 10.0
    interactive: Annotated[float, msgspec.Meta(gt=0, le=1e9)] = 100.0


class DeratingConfig(_Section):
    """Controller-side anomaly score → quantised capacity derating (docs/algorithms.md §4).

    Attributes
    ----------
    window_s : float
        Measurement window of the anomaly score, seconds.
    enter_windows : int
        Consecutive bad windows before an engine steps down one derating level.
    exit_windows : int
        Consecutive good windows before it steps back up one level.
    z_enter : float
        Robust z-score of the latency residual above which a window is bad.
    z_exit : float
        Robust z-score below which a window is good; less than ``z_enter``.
    error_rate_enter : float
        Lower confidence bound of the error rate above which a window is bad.
    error_rate_exit : float
        Error-rate bound below which a window is good; less than ``error_rate_enter``.
    min_change_interval_s : float
        Least time between two level changes of one engine, seconds.
    max_derated_fraction : float
        Most of a group's capacity that may be derated; beyond it derating freezes
        (the profile, not the engines, is assumed wrong).
    """

    window_s: PositiveSeconds = 30.0
    enter_windows: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 3
    exit_windows: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 6
    z_enter: Annotated[float, msgspec.Meta(gt=0, le=100)] = 3.0
    z_exit: Annotated[float, msgspec.Meta(gt=0, le=100)] = 1.5
    error_rate_enter: Fraction = 0.05
    error_rate_exit: Fraction = 0.01
    min_change_interval_s: PositiveSeconds = 60.0
    max_derated_fraction: Fraction = 0.25


class ControllerHaConfig(_Section):
    """Several controllers on etcd, one leading (``[controller.ha]``; docs/operations.md
    "Running several controllers"). Off while ``etcd_urls`` is empty: one controller, as before.

    Attributes
    ----------
    etcd_urls : array of str
        Client URLs of the etcd members (``http://host:2379``); ``fastroute controller --etcd``
        overrides them. Every call tries them in turn.
    lease_ttl_s : int
        Lease TTL of the election, seconds. A dead leader is replaced after at most this plus
        etcd's lease-expiry check (500 ms) plus a follower's campaign interval (TTL/10), plus
        one period to publish; the leader renews every TTL/3
        and stops publishing TTL/4 before its lease could expire, so a stall (GC pause, blocked
        scrape, etcd leader change ~1 s) that starts when its last renewal is up to TTL/3 old
        costs nothing if shorter than TTL x 5/12 (4.2 s at 10 s; a 2 s TTL's 0.83 s was too
        short for one etcd leader change on a loaded machine). 10 s keeps failover within about
        two default periods while absorbing multi-second stalls.
    election_key : str
        The etcd key the leader creates under its lease (value: its ``advertise_url``); all
        controllers of one deployment share it, another deployment uses another key.
    advertise_url : str or None
        The URL followers redirect ``GET /v1/table`` to while this controller leads, and the
        proxies reach it by; None: ``http://<host>:<port>`` of the listening socket.
    etcd_timeout_s : float
        Timeout of one etcd call on one member, seconds; below TTL/3 so a dead member costs
        less than one renewal interval before the next is tried.
    """

    etcd_urls: Annotated[tuple[str, ...], msgspec.Meta(max_length=16)] = ()
    lease_ttl_s: Annotated[int, msgspec.Meta(ge=1, le=300)] = 10
    election_key: Annotated[
        str, msgspec.Meta(min_length=2, max_length=512, pattern=r"^/[A-Za-z0-9._/-]+$")
    ] = "/fastroute/controller/leader"
    advertise_url: Annotated[str, msgspec.Meta(min_length=1, max_length=2048)] | None = None
    etcd_timeout_s: PositiveSeconds = 1.0

    def __post_init__(self) -> None:
        for url in self.etcd_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"controller.ha.etcd_urls: {url!r} must start with http://")
        if self.etcd_urls and self.etcd_timeout_s >= self.lease_ttl_s / 3:
            raise ValueError(
                f"controller.ha.etcd_timeout_s ({self.etcd_timeout_s}) must be below "
                f"lease_ttl_s / 3 ({self.lease_ttl_s / 3:g}): a renewal must fit its interval"
            )


class ControllerConfig(_Section):
    """The control plane process (``fastroute controller``; docs/algorithms.md §1).

    Attributes
    ----------
    host : str
        Listen address of the HTTP API (snapshots, reports, plan).
    port : int
        Listen port; 0 picks a free port (tests).
    period_s : float
        Control period: collect signals, solve the LP, publish weights, seconds.
    kappa_s : float
        L1 move penalty κ of the LP, seconds per req/s of moved traffic: a pair's
        traffic moves only when its marginal-cost gap exceeds 2κ.
    breakpoints : array of floats
        Utilisation grid b_1 < … < b_K of the piecewise-linear latency segments
        (b_0 = 0 is implicit); strictly increasing, each in (0, 1). The last one is
        the utilisation cap ρ_max.
    shed_base_factor : float
        P₀ = this × the largest segment slope, so shedding happens only when demand
        cannot be served.
    solve_time_limit_s : float
        HiGHS time limit per solve, seconds; less than ``period_s``. On failure the
        last good weights stay published.
    scrape_interval_s : float
        How often the controller scrapes engine ``/metrics`` and ``/health``, seconds.
        Twice per default period: the windows are differences of cumulative counters
        (the same at any cadence) and a period uses only the last gauges, so faster
        scrapes buy only earlier staleness (after 3 intervals) at ~1 ms of CPU per
        engine and scrape.
    scrape_timeout_s : float
        Timeout of one scrape, seconds; less than ``scrape_interval_s``.
    long_poll_timeout_s : float
        Longest a ``GET /v1/table?after=<generation>`` waits for a new generation.
    max_reuse_gain : float
        Cap on how much measured prefix reuse raises an engine group's capacity over its
        ``capacity_rps`` (rated without reuse): ``(Q + G) / (Q − H + G)`` from the engines'
        queried, cached and generated token counters over the last minute
        (``controller/reuse.py``). 4 = three quarters of the token work cached; the window is
        history, so this bounds how far a workload that turns uncached can find the fleet
        over-rated. 1 plans with ``capacity_rps`` alone. In [1, 100].
    shed_penalties : table
        Per-priority shed penalty multipliers, ``[controller.shed_penalties]``.
    derating : table
        Anomaly scoring and derating, ``[controller.derating]``.
    ha : table
        Several controllers on etcd, ``[controller.ha]``.
    """

    host: Host = "127.0.0.1"
    port: Port = 8090
    period_s: PositiveSeconds = 5.0
    kappa_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 0.4
    breakpoints: Annotated[tuple[float, ...], msgspec.Meta(min_length=1, max_length=64)] = (
        0.30,
        0.50,
        0.65,
        0.75,
        0.83,
        0.89,
        0.93,
        0.95,
    )
    shed_base_factor: Annotated[float, msgspec.Meta(ge=1, le=1e6)] = 10.0
    solve_time_limit_s: PositiveSeconds = 1.0
    scrape_interval_s: PositiveSeconds = 2.5
    scrape_timeout_s: PositiveSeconds = 0.5
    long_poll_timeout_s: PositiveSeconds = 30.0
    max_reuse_gain: Annotated[float, msgspec.Meta(ge=1, le=100)] = 4.0
    shed_penalties: ShedPenaltiesConfig = ShedPenaltiesConfig()
    derating: DeratingConfig = DeratingConfig()
    ha: ControllerHaConfig = ControllerHaConfig()


# --------------------------------------------------------------------------------------------
# Root


class TracingConfig(_Section):
    """OpenTelemetry traces of the request path (docs/operations.md, "Tracing"); off by default.

    With ``enabled`` false the request path creates no span and attaches no context: one
    attribute check per request. With it on, each request gets a ``fastroute.request`` span
    (a child of the client's W3C ``traceparent`` when it sent one) with child spans for
    classify, admission, pick, each attempt and each migration segment, and every attempt
    sends the engine its own ``traceparent`` so the engine's spans join the trace.

    Attributes
    ----------
    enabled : bool
        Export spans.
    sample_ratio : float
        Fraction of new traces sampled (a parent-based ratio sampler: a request whose
        client sent a ``traceparent`` follows the client's sampled flag). 1.0 samples every
        request; lower it when the collector cannot take one trace per request.
    otlp_endpoint : str
        The OTLP/HTTP (protobuf) traces URL of the collector, e.g.
        ``http://127.0.0.1:4318/v1/traces``. Empty: spans are made but sent nowhere (tests
        give the tracer their own exporter).
    service_name : str
        The ``service.name`` resource attribute of the proxy's spans.
    max_queue_size : int
        Spans the batch processor holds before it drops new ones (a bounded queue per
        worker): 2048 is the SDK's default, about 300 requests of seven spans each, more
        than one ``schedule_delay_s`` of traffic at the rates one worker serves.
    max_export_batch_size : int
        Spans per export request; at most ``max_queue_size``.
    schedule_delay_s : float
        Longest a span waits in the queue before it is exported, seconds (the SDK's 5 s).
    export_timeout_s : float
        Longest one export may take, seconds; the export runs on the processor's own
        thread, never on the event loop.
    """

    enabled: bool = False
    sample_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] = 1.0
    otlp_endpoint: Annotated[str, msgspec.Meta(max_length=2048, pattern=r"^(https?://\S+)?$")] = ""
    service_name: Name = "fastroute-proxy"
    max_queue_size: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 2048
    max_export_batch_size: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 512
    schedule_delay_s: PositiveSeconds = 5.0
    export_timeout_s: PositiveSeconds = 30.0


class Config(_Section):
    """The whole file: everything the proxy and the controller need.

    Attributes
    ----------
    engines : array of tables
        The engines, ``[[engines]]``; at least one.
    hardware_classes : array of strings
        Hardware class labels engines and tenants may use. The default is the built-in
        datasheet profiles (``fastroute.hardware``); real fleets list their own (e.g.
        ``"h100-sxm"``).
    network : table
        Regions, zones and the RTT matrix, ``[network]``.
    tenants : array of tables
        Tenants, ``[[tenants]]``. With none, authentication is off: every request is
        anonymous and may use every zone.
    classes : array of tables
        Request classes, ``[[classes]]``; requests without a class get the defaults.
    policy : table
        Engine selection, ``[policy]``.
    retry : table
        Retry budget, ``[retry]``.
    ejection : table
        Local outlier ejection, ``[ejection]``.
    admission : table
        Queue-delay admission, ``[admission]``.
    timeouts : table
        Upstream timeouts, ``[timeouts]``.
    limits : table
        Request limits, ``[limits]``.
    proxy : table
        The data plane process, ``[proxy]``.
    controller : table
        The control plane process, ``[controller]``.
    tracing : table
        OpenTelemetry traces of the request path, ``[tracing]`` (off by default).
    discovery : array of tables
        Engines found in DNS, ``[[discovery]]``; they join the ``[[engines]]`` (and the
        engines added through the admin API) in the fleet in force.
    """

    engines: Annotated[tuple[EngineConfig, ...], msgspec.Meta(min_length=1)]
    hardware_classes: Annotated[tuple[Name, ...], msgspec.Meta(min_length=1)] = (
        DEFAULT_HARDWARE_CLASSES
    )
    network: NetworkConfig = NetworkConfig()
    tenants: tuple[TenantConfig, ...] = ()
    classes: tuple[ClassConfig, ...] = ()
    policy: PolicyConfig = PolicyConfig()
    retry: RetryConfig = RetryConfig()
    ejection: EjectionConfig = EjectionConfig()
    admission: AdmissionConfig = AdmissionConfig()
    timeouts: TimeoutsConfig = TimeoutsConfig()
    limits: LimitsConfig = LimitsConfig()
    proxy: ProxyConfig = ProxyConfig()
    controller: ControllerConfig = ControllerConfig()
    tracing: TracingConfig = TracingConfig()
    discovery: tuple[DiscoveryConfig, ...] = ()

    def engine(self, name: str) -> EngineConfig:
        """Return the engine called ``name``; raise ``KeyError`` if there is none."""
        for engine in self.engines:
            if engine.name == name:
                return engine
        raise KeyError(f"unknown engine {name!r}")

    def models(self) -> tuple[str, ...]:
        """Return the sorted union of the engines' models (what ``GET /v1/models`` lists)."""
        return tuple(sorted({m for e in self.engines for m in e.models}))

    def class_for(self, model: str, priority: str) -> ClassConfig:
        """Return the class of a request for ``model`` at ``priority``.

        The class naming ``model`` at ``priority`` wins, then the ``*`` class at
        ``priority``; otherwise a class with the default SLOs and policy, named
        ``"{model}/{priority}"``.
        """
        wildcard = None
        for cls in self.classes:
            if cls.priority == priority:
                if cls.model == model:
                    return cls
                if cls.model == "*" and wildcard is None:
                    wildcard = cls
        if wildcard is not None:
            return wildcard
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {PRIORITIES}, got {priority!r}")
        return ClassConfig(
            name=f"{model}/{priority}",
            model=model,
            priority=typing.cast(Priority, priority),
        )

    def policy_for(self, cls: ClassConfig) -> str:
        """Return the policy name of class ``cls`` (its own, else ``policy.default``)."""
        return cls.policy or self.policy.default


def hash_api_key(key: str) -> str:
    """Return the SHA-256 hex digest of an API key, as ``api_key_sha256`` expects.

    Parameters
    ----------
    key : str
        The key as clients send it after ``Bearer ``; encoded as UTF-8.

    Returns
    -------
    str
        64 lowercase hex digits.
    """
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | Path) -> Config:
    """Read, decode and validate the TOML config file at ``path``.

    Parameters
    ----------
    path : str or Path
        The file.

    Returns
    -------
    Config
        Validated, with every engine's ``zone`` filled in.

    Raises
    ------
    ConfigError
        The file cannot be read, is not TOML, or fails validation; the message names
        the file and the JSON path of the bad value.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(str(path), [(None, f"cannot read config file: {exc}")]) from exc
    return decode_config(data, source=str(path))


def decode_config(text: str | bytes, source: str = "<string>") -> Config:
    """Decode and validate a config from TOML text.

    Parameters
    ----------
    text : str or bytes
        TOML document (bytes must be UTF-8).
    source : str
        Name for error messages, usually the file name.

    Returns
    -------
    Config
        Validated, with every engine's ``zone`` filled in.

    Raises
    ------
    ConfigError
        On TOML syntax errors (with the line), type or range errors, unknown keys, or
        cross-field problems; the message names ``source`` and the JSON path.
    """
    if isinstance(text, bytes | bytearray | memoryview):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(source, [(None, f"expected UTF-8 text: {exc}")]) from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        match = re.search(r"line (\d+)", str(exc))
        lineno = int(match.group(1)) if match else None
        raise ConfigError(source, [(None, f"invalid TOML: {exc}")], lineno=lineno) from exc
    try:
        config = msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        path, message = _explain_validation_error(str(exc))
        raise ConfigError(source, [(path, message)]) from exc
    return validate_config(config, source=source)


def decode_engine(data: object, source: str = "<engine>") -> EngineConfig:
    """Decode one ``[[engines]]`` entry from built-in types (a parsed JSON object).

    Only the entry's own types and ranges are checked; the rules across the fleet
    (unique names and addresses, known regions) are :func:`validate_config`'s.

    Raises
    ------
    ConfigError
        The entry is not an object of valid engine fields; the message names the field.
    """
    try:
        return msgspec.convert(data, EngineConfig)
    except msgspec.ValidationError as exc:
        message = str(exc)
        match = _MSGSPEC_PATH.search(message)
        path = match.group(1) if match else "$"
        raise ConfigError(source, [(path, message[: match.start()] if match else message)]) from exc


def validate_config(config: Config, source: str = "<config>") -> Config:
    """Check the cross-field rules of a decoded (or hand-built) config.

    Parameters
    ----------
    config : Config
        Typically from ``msgspec.convert``; Structs built in Python are not
        range-checked by msgspec, so tests and the demo should pass them through
        ``msgspec.convert(msgspec.to_builtins(config), Config)`` first if unsure.
    source : str
        Name for error messages.

    Returns
    -------
    Config
        ``config`` with every engine's ``zone`` resolved from its region.

    Raises
    ------
    ConfigError
        Listing every problem found, each with its JSON path.
    """
    problems = list(_cross_field_problems(config))
    if problems:
        raise ConfigError(source, problems)
    region_zone = {r.name: r.zone for r in config.network.regions}
    engines = tuple(
        e if e.zone is not None else msgspec.structs.replace(e, zone=region_zone[e.region])
        for e in config.engines
    )
    return msgspec.structs.replace(config, engines=engines)


_MSGSPEC_PATH = re.compile(r" - at `(\$[^`]*)`$")


def _explain_validation_error(message: str) -> tuple[str, str]:
    """Split msgspec's message into (path, text) and add what was expected where it can."""
    match = _MSGSPEC_PATH.search(message)
    path = match.group(1) if match else "$"
    text = message[: match.start()] if match else message
    target = _type_at(path)
    if text.startswith("Invalid enum value") and target is not None:
        choices = _literal_choices(target)
        if choices:
            text += f"; expected one of {', '.join(repr(c) for c in choices)}"
    unknown = re.match(r"Object contains unknown field `([^`]*)`", text)
    if unknown and target is not None:
        struct = _struct_of(target)
        if struct is not None:
            known = [f.encode_name for f in msgspec.structs.fields(struct)]
            close = difflib.get_close_matches(unknown.group(1), known, n=1)
            hint = f"did you mean `{close[0]}`? " if close else ""
            text += f"; {hint}known fields: {', '.join(known)}"
    return path, text


_PATH_TOKEN = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+|\.\.\.)\]")


def _type_at(path: str) -> Any:
    """The annotation of the value at JSON ``path`` within :class:`Config`, or None."""
    tp: Any = Config
    pos = 1  # after "$"
    while pos < len(path):
        match = _PATH_TOKEN.match(path, pos)
        if match is None:
            return None
        pos = match.end()
        tp = _strip(tp)
        if match.group(1) is not None:
            struct = _struct_of(tp)
            if struct is None:
                return None
            hints = typing.get_type_hints(struct, include_extras=True)
            if match.group(1) not in hints:
                return None
            tp = hints[match.group(1)]
        else:
            args = typing.get_args(tp)
            origin = typing.get_origin(tp)
            if origin is tuple and args:
                tp = args[0]
            elif origin is dict and args:
                tp = args[1]
            else:
                return None
    return tp


def _strip(tp: Any) -> Any:
    """Remove ``Annotated`` and ``| None`` wrappers."""
    while True:
        origin = typing.get_origin(tp)
        if origin is Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp
            tp = args[0]
        else:
            return tp


def _struct_of(tp: Any) -> type[msgspec.Struct] | None:
    tp = _strip(tp)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return tp
    return None


def _literal_choices(tp: Any) -> tuple[Any, ...]:
    tp = _strip(tp)
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else ()


# --------------------------------------------------------------------------------------------
# Cross-field rules


def _url_problem(url: str) -> str | None:
    """Why ``url`` is not an ``http(s)://host:port`` server root, or None if it is."""
    expected = "expected http://host:port or https://host:port"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"{expected}, got {url!r} ({exc})"
    if parts.scheme not in ("http", "https"):
        return f"{expected}, got {url!r} (scheme {parts.scheme!r})"
    if not parts.hostname:
        return f"{expected}, got {url!r} (no host)"
    if port is None or port == 0:
        return f"expected an explicit port (http://host:port), got {url!r}"
    if parts.username is not None or parts.password is not None:
        return f"{expected} without credentials, got {url!r} (use the engine's api_key)"
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        return (
            f"{expected} with no path, got {url!r} "
            "(give the server root; fastroute appends /v1/..., /metrics and /health)"
        )
    return None


def _host_port(url: str) -> tuple[str, int] | None:
    parts = urlsplit(url)
    if parts.hostname is None or parts.port is None:
        return None
    return parts.hostname.lower(), parts.port


def _pd_kind_problems(config: Config) -> Iterator[tuple[str, str]]:
    """A model's prefill and decode engines must speak one P/D protocol: SGLang's
    bootstrap protocol (all ``sglang``) or vLLM's ``kv_transfer_params`` (none)."""
    pd_engines: dict[str, list[int]] = {}
    for i, engine in enumerate(config.engines):
        if engine.role != "both":
            for model in engine.models:
                pd_engines.setdefault(model, []).append(i)
    for model, indices in pd_engines.items():
        sglang = [i for i in indices if config.engines[i].kind == "sglang"]
        if sglang and len(sglang) != len(indices):
            other = next(i for i in indices if i not in sglang)
            yield (
                f"$.engines[{other}].kind",
                f"model {model!r} mixes P/D protocols: engine "
                f"{config.engines[sglang[0]].name!r} is kind 'sglang' (bootstrap protocol) but "
                f"{config.engines[other].name!r} is kind {config.engines[other].kind!r} (vLLM "
                "kv_transfer_params); a model's prefill and decode engines must all be 'sglang' "
                "or none",
            )


def _discovery_problems(
    config: Config,
    regions: list[str],
    zones: list[str],
    hardware: set[str],
    unknown: Callable[[str, str, Sequence[str]], str],
) -> Iterator[tuple[str, str]]:
    """The ``[[discovery]]`` rules: unique names, a port for A records, known labels."""
    seen: dict[str, int] = {}
    for i, disc in enumerate(config.discovery):
        at = f"$.discovery[{i}]"
        if disc.name in seen:
            yield (
                f"{at}.name",
                f"duplicate discovery name {disc.name!r} (also $.discovery[{seen[disc.name]}])",
            )
        seen.setdefault(disc.name, i)
        if disc.record == "A" and disc.port is None:
            yield f"{at}.port", "record 'A' needs the engines' port (SRV records carry theirs)"
        if disc.timeout_s >= disc.interval_s:
            yield (
                f"{at}.timeout_s",
                f"expected less than interval_s ({disc.interval_s} s), got {disc.timeout_s}",
            )
        if disc.region not in regions:
            yield f"{at}.region", unknown("region", disc.region, regions)
        if disc.zone is not None and disc.zone not in zones:
            yield f"{at}.zone", unknown("zone (a region's zone)", disc.zone, zones)
        if disc.hardware not in hardware:
            yield f"{at}.hardware", unknown("hardware class", disc.hardware, list(hardware))


def _cross_field_problems(config: Config) -> Iterator[tuple[str, str]]:
    """Yield ``(json_path, message)`` for every cross-field rule ``config`` breaks."""
    tracing = config.tracing
    if tracing.max_export_batch_size > tracing.max_queue_size:
        yield (
            "$.tracing.max_export_batch_size",
            f"must be at most tracing.max_queue_size ({tracing.max_queue_size}), "
            f"got {tracing.max_export_batch_size}",
        )
    # Regions and zones.
    regions: dict[str, RegionConfig] = {}
    for i, region in enumerate(config.network.regions):
        if region.name in regions:
            yield f"$.network.regions[{i}].name", f"duplicate region name {region.name!r}"
        regions.setdefault(region.name, region)
    zones = sorted({r.zone for r in config.network.regions})
    hardware = set(config.hardware_classes)
    for i, name in enumerate(config.hardware_classes):
        if name in config.hardware_classes[:i]:
            yield f"$.hardware_classes[{i}]", f"duplicate hardware class {name!r}"

    def unknown(kind: str, value: str, known: Sequence[str]) -> str:
        close = difflib.get_close_matches(value, list(known), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"expected a declared {kind}, one of {sorted(known)}, got {value!r}{hint}"

    # RTT matrix.
    for src, row in config.network.rtt_ms.items():
        if src not in regions:
            yield f"$.network.rtt_ms.{src}", unknown("region", src, list(regions))
            continue
        for dst, value in row.items():
            path = f"$.network.rtt_ms.{src}.{dst}"
            if dst not in regions:
                yield path, unknown("region", dst, list(regions))
            elif not (value >= 0 and value != float("inf")):
                yield path, f"expected a finite RTT >= 0 ms, got {value!r}"
    names = list(regions)
    for a_i, a in enumerate(names):
        for b in names[a_i + 1 :]:
            if b not in config.network.rtt_ms.get(a, {}) and a not in config.network.rtt_ms.get(
                b, {}
            ):
                yield (
                    "$.network.rtt_ms",
                    f"expected an RTT between regions {a!r} and {b!r} "
                    f"(set rtt_ms.{a}.{b}; the reverse direction defaults to it)",
                )

    # Engines.
    seen_names: dict[str, int] = {}
    seen_urls: dict[tuple[str, int], int] = {}
    listen = {
        ("proxy", config.proxy.host.lower(), config.proxy.port),
        ("controller", config.controller.host.lower(), config.controller.port),
    }
    for i, engine in enumerate(config.engines):
        at = f"$.engines[{i}]"
        if engine.name in seen_names:
            other = seen_names[engine.name]
            yield f"{at}.name", f"duplicate engine name {engine.name!r} (also $.engines[{other}])"
        seen_names.setdefault(engine.name, i)
        problem = _url_problem(engine.url)
        if problem is not None:
            yield f"{at}.url", problem
        else:
            hp = _host_port(engine.url)
            assert hp is not None
            if hp in seen_urls:
                yield (
                    f"{at}.url",
                    f"expected a unique engine address, but {engine.url!r} is also "
                    f"$.engines[{seen_urls[hp]}]'s",
                )
            seen_urls.setdefault(hp, i)
            for process, host, port in listen:
                if port and hp == (host, port):
                    yield (
                        f"{at}.url",
                        f"engine address {engine.url!r} is the {process}'s own listen address",
                    )
        for j, model in enumerate(engine.models):
            if model in engine.models[:j]:
                yield f"{at}.models[{j}]", f"duplicate model {model!r}"
        if engine.region not in regions:
            yield f"{at}.region", unknown("region", engine.region, list(regions))
        if engine.zone is not None and engine.zone not in zones:
            yield f"{at}.zone", unknown("zone (a region's zone)", engine.zone, zones)
        if engine.hardware not in hardware:
            yield f"{at}.hardware", unknown("hardware class", engine.hardware, list(hardware))
        if engine.bootstrap_port is not None and (
            engine.kind != "sglang" or engine.role != "prefill"
        ):
            yield (
                f"{at}.bootstrap_port",
                f"bootstrap_port is for SGLang prefill engines (kind 'sglang', role 'prefill'); "
                f"this engine is kind {engine.kind!r}, role {engine.role!r}",
            )

    def engine_zone(engine: EngineConfig) -> str | None:
        if engine.zone is not None:
            return engine.zone
        region = regions.get(engine.region)
        return region.zone if region is not None else None

    # Every served model needs a whole-request path: a `both` engine or a P/D pair.
    roles: dict[str, set[str]] = {}
    first: dict[str, int] = {}
    for i, engine in enumerate(config.engines):
        for model in engine.models:
            roles.setdefault(model, set()).add(engine.role)
            first.setdefault(model, i)
    for model, have in roles.items():
        if "both" not in have and not {"prefill", "decode"} <= have:
            missing = "decode" if "prefill" in have else "prefill"
            yield (
                f"$.engines[{first[model]}].role",
                f"model {model!r} has {'/'.join(sorted(have))} engines but no {missing!r} or "
                "'both' engine, so no request for it can complete",
            )
    yield from _pd_kind_problems(config)
    yield from _discovery_problems(config, list(regions), zones, hardware, unknown)

    # Tenants.
    tenant_names: set[str] = set()
    key_owner: dict[str, str] = {}
    for i, tenant in enumerate(config.tenants):
        at = f"$.tenants[{i}]"
        if tenant.name in tenant_names:
            yield f"{at}.name", f"duplicate tenant name {tenant.name!r}"
        tenant_names.add(tenant.name)
        for j, zone in enumerate(tenant.zones):
            if zone not in zones:
                yield f"{at}.zones[{j}]", unknown("zone (a region's zone)", zone, zones)
        if tenant.hardware is not None and tenant.hardware not in hardware:
            yield f"{at}.hardware", unknown("hardware class", tenant.hardware, list(hardware))
        hashed = [(f"{at}.api_keys[{j}]", hash_api_key(k)) for j, k in enumerate(tenant.api_keys)]
        hashed += [(f"{at}.api_key_sha256[{j}]", h) for j, h in enumerate(tenant.api_key_sha256)]
        for path, digest in hashed:
            owner = key_owner.get(digest)
            if owner is not None:
                yield path, f"expected each API key to identify one tenant; already {owner}"
            key_owner.setdefault(digest, f"tenant {tenant.name!r}")
        if tenant.hardware is not None:
            eligible = [
                e
                for e in config.engines
                if e.hardware == tenant.hardware
                and (not tenant.zones or engine_zone(e) in tenant.zones)
            ]
            if not eligible:
                yield (
                    f"{at}.hardware",
                    f"no engine of hardware {tenant.hardware!r} in the tenant's zones",
                )

    # Classes.
    served = set(roles)
    class_names: set[str] = set()
    class_keys: dict[tuple[str, str], str] = {}
    for i, cls in enumerate(config.classes):
        at = f"$.classes[{i}]"
        if cls.name in class_names:
            yield f"{at}.name", f"duplicate class name {cls.name!r}"
        class_names.add(cls.name)
        key = (cls.model, cls.priority)
        if key in class_keys:
            yield (
                f"{at}.priority",
                f"expected one class per (model, priority); {cls.model!r} at {cls.priority!r} "
                f"is already class {class_keys[key]!r}",
            )
        class_keys.setdefault(key, cls.name)
        if cls.model != "*" and cls.model not in served:
            yield f"{at}.model", unknown("model (served by some engine)", cls.model, list(served))

    # Policy tunables.
    for name in config.policy.params:
        if name not in POLICY_NAMES:
            yield f"$.policy.params.{name}", unknown("policy name", name, POLICY_NAMES)

    # Proxy.
    if config.proxy.cluster not in regions:
        yield "$.proxy.cluster", unknown("region", config.proxy.cluster, list(regions))
    if config.proxy.default_tenant is not None and config.proxy.default_tenant not in tenant_names:
        yield (
            "$.proxy.default_tenant",
            unknown("tenant", config.proxy.default_tenant, sorted(tenant_names)),
        )
    if config.proxy.controller_url is not None:
        problem = _url_problem(config.proxy.controller_url)
        if problem is not None:
            yield "$.proxy.controller_url", problem
    for i, url in enumerate(config.proxy.controller_fallback_urls):
        problem = _url_problem(url)
        if problem is not None:
            yield f"$.proxy.controller_fallback_urls[{i}]", problem
    for i, url in enumerate(config.proxy.peers):
        problem = _url_problem(url)
        if problem is not None:
            yield f"$.proxy.peers[{i}]", problem
        elif url.rstrip("/") in (u.rstrip("/") for u in config.proxy.peers[:i]):
            yield f"$.proxy.peers[{i}]", f"expected distinct peers, {url!r} repeats"
    headers = ("session_header", "priority_header", "zone_header")
    lowered = [getattr(config.proxy, h).lower() for h in headers]
    for i, header in enumerate(headers):
        if lowered[i] in lowered[:i]:
            yield f"$.proxy.{header}", f"expected distinct header names, {lowered[i]!r} repeats"
    if config.proxy.table_name == config.proxy.stats_name:
        yield "$.proxy.stats_name", "expected a segment name different from table_name"
    if config.proxy.scrape_timeout_s >= config.proxy.scrape_interval_s:
        yield "$.proxy.scrape_timeout_s", "expected less than proxy.scrape_interval_s"
    same_host = config.proxy.host.lower() == config.controller.host.lower()
    if same_host and config.proxy.port and config.proxy.port == config.controller.port:
        yield "$.controller.port", f"expected a port other than the proxy's {config.proxy.port}"

    # Timeouts and budgets.
    t = config.timeouts
    for name in ("connect_timeout_s", "first_byte_timeout_s", "idle_timeout_s"):
        if getattr(t, name) > t.total_timeout_s:
            yield f"$.timeouts.{name}", f"expected at most total_timeout_s ({t.total_timeout_s})"
    ej = config.ejection
    if ej.max_ejection_s < ej.base_ejection_s:
        yield (
            "$.ejection.max_ejection_s",
            f"expected at least base_ejection_s ({ej.base_ejection_s})",
        )
    for j, status in enumerate(config.retry.retry_on_status):
        if status in config.retry.retry_on_status[:j]:
            yield f"$.retry.retry_on_status[{j}]", f"duplicate status {status}"

    # Controller.
    c = config.controller
    previous = 0.0
    for j, point in enumerate(c.breakpoints):
        path = f"$.controller.breakpoints[{j}]"
        if not 0.0 < point < 1.0:
            yield path, f"expected a utilisation in (0, 1), got {point!r}"
        elif point <= previous:
            yield (
                path,
                f"expected strictly increasing breakpoints, got {point!r} after {previous!r}",
            )
        else:
            previous = point
    if c.solve_time_limit_s >= c.period_s:
        yield "$.controller.solve_time_limit_s", f"expected less than period_s ({c.period_s})"
    if c.scrape_timeout_s >= c.scrape_interval_s:
        yield "$.controller.scrape_timeout_s", "expected less than controller.scrape_interval_s"
    sp = c.shed_penalties
    if sp.default < sp.batch:
        yield "$.controller.shed_penalties.default", f"expected at least batch ({sp.batch})"
    if sp.interactive < sp.default:
        yield (
            "$.controller.shed_penalties.interactive",
            f"expected at least default ({sp.default})",
        )
    d = c.derating
    if d.z_exit >= d.z_enter:
        yield "$.controller.derating.z_exit", f"expected less than z_enter ({d.z_enter})"
    if d.error_rate_exit >= d.error_rate_enter:
        yield (
            "$.controller.derating.error_rate_exit",
            f"expected less than error_rate_enter ({d.error_rate_enter})",
        )


# --------------------------------------------------------------------------------------------
# Documentation


_PREAMBLE = """\
# Configuration

<!-- Generated by `python -m fastroute.config > docs/configuration.md` from the Structs in
fastroute/config.py. Do not edit by hand: tests/unit/test_config.py fails when it is stale. -->

The proxy (`fastroute serve`) and the controller (`fastroute controller`) read one TOML file,
decoded into frozen msgspec Structs (`fastroute.config.Config`). `examples/fastroute.toml` is a
commented example that works as is with the engines of
`fastroute engine --count 4 --base-port 9100 --model demo-8b`.
Check a file without starting anything: `python -m fastroute.config FILE`.

A bad file stops the process at start with a `ConfigError` that names the file, what was expected
and the JSON path of the bad value:

```text
fastroute.toml: Expected `float` > 0.0 - at `$.timeouts.connect_timeout_s`
fastroute.toml: Object contains unknown field `prot`; did you mean `port`? ... - at `$.proxy`
fastroute.toml: invalid TOML: Invalid value (at line 12, column 9)
```

Units are in the key names: `_s` seconds, `_ms` milliseconds, `_rps` requests per second,
`_bytes` bytes. Unknown keys are errors. Arrays of tables (`[[engines]]`) are written once per
element.

## Cross-field rules

Checked after the types and ranges below; all violations are reported together, each with its path.

* Names are unique: regions, engines, tenants, classes, hardware classes; one class per
  (model, priority); an API key (clear or hashed) identifies one tenant.
* Engine `url` is `http(s)://host:port`: explicit port, no path, query or credentials; no two
  engines share an address, and none is the proxy's or controller's own listen address.
* Engine `region`, `proxy.cluster` and the keys of `network.rtt_ms` are declared regions; engine
  and tenant zones are zones of declared regions; engine and tenant `hardware` are in
  `hardware_classes`.
* `network.rtt_ms` covers every pair of declared regions (a missing direction takes the reverse
  direction's value; a missing diagonal is 0); values are finite and >= 0.
* Every model has a `both` engine or a `prefill` and a `decode` engine; a class's `model` is `*`
  or served by some engine; a tenant's `hardware` has engines in the tenant's zones;
  `proxy.default_tenant` is a declared tenant.
* `controller.breakpoints` are strictly increasing, each in (0, 1).
* Ordering: connect/first-byte/idle timeouts <= `total_timeout_s`; `max_ejection_s` >=
  `base_ejection_s`; scrape timeouts < scrape intervals; `solve_time_limit_s` < `period_s`;
  shed penalties batch <= default <= interactive; derating exit thresholds < enter thresholds.
* `proxy.controller_url`, when set, is `http(s)://host:port`; the proxy and controller do not
  listen on the same host and port; the three proxy header names differ; `table_name` differs
  from `stats_name`.
"""

_TOML_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "float", bool: "boolean"}


def _type_text(tp: Any) -> str:
    """A TOML-flavoured name for an annotation."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Annotated:
        return _type_text(args[0])
    if origin is Literal:
        return "one of " + ", ".join(f'"{a}"' for a in args)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        inner = " or ".join(_type_text(a) for a in rest)
        return f"{inner} (optional)" if len(rest) < len(args) else inner
    if origin is tuple:
        inner = _strip(args[0])
        if _struct_of(inner) is not None:
            return "array of tables"
        return f"array of {_type_text(inner)}s"
    if origin is dict:
        return f"table of {_type_text(args[1])}"
    if _struct_of(tp) is not None:
        return "table"
    return _TOML_TYPES.get(tp, getattr(tp, "__name__", str(tp)))


def _metas(tp: Any) -> list[msgspec.Meta]:
    metas: list[msgspec.Meta] = []
    while typing.get_origin(tp) is Annotated:
        args = typing.get_args(tp)
        metas.extend(m for m in args[1:] if isinstance(m, msgspec.Meta))
        tp = args[0]
    return metas


def _constraint_text(tp: Any) -> str:
    """Human-readable ``msgspec.Meta`` constraints on an annotation (and its items)."""
    parts: list[str] = []
    for meta in _metas(tp):
        for attr, symbol in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            value = getattr(meta, attr)
            if value is not None:
                parts.append(
                    f"{symbol} {value:g}" if isinstance(value, float) else f"{symbol} {value}"
                )
        lo, hi = meta.min_length, meta.max_length
        if lo is not None and hi is not None:
            parts.append(f"length {lo}–{hi}")
        elif lo is not None:
            parts.append(f"length >= {lo}")
        elif hi is not None:
            parts.append(f"length <= {hi}")
        if meta.pattern is not None:
            parts.append(f"matches `{meta.pattern}`")
    base = tp
    while typing.get_origin(base) is Annotated:
        base = typing.get_args(base)[0]
    origin = typing.get_origin(base)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(base) if a is not type(None)]
        if len(inner) == 1:
            text = _constraint_text(inner[0])
            if text:
                parts.append(text)
    elif origin is tuple:
        text = _constraint_text(typing.get_args(base)[0])
        if text:
            return "; ".join([", ".join(parts), f"each: {text}"] if parts else [f"each: {text}"])
    return ", ".join(parts)


def _default_text(field: msgspec.structs.FieldInfo, section: dict[type, str]) -> str:
    if field.default is msgspec.NODEFAULT and field.default_factory is msgspec.NODEFAULT:
        return "required"
    value = field.default if field.default is not msgspec.NODEFAULT else field.default_factory()
    if value is None:
        return "unset"
    struct = _struct_of(field.type)
    if struct is not None:
        return f"see `{section[struct]}`"
    return f"`{_toml_value(value)}`"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, msgspec.Struct):
        items = msgspec.structs.asdict(value)
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in items.items()) + "}"
    return repr(value)


def _docstring_parts(cls: type) -> tuple[str, dict[str, str]]:
    """(summary paragraph, {attribute: description}) from a numpydoc class docstring."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    lines = doc.splitlines()
    summary: list[str] = []
    attributes: dict[str, str] = {}
    i = 0
    while i < len(lines) and lines[i].strip() != "Attributes":
        summary.append(lines[i])
        i += 1
    i += 2  # "Attributes" and its underline
    current: str | None = None
    while i < len(lines):
        line = lines[i]
        if i + 1 < len(lines) and re.fullmatch(r"-{3,}", lines[i + 1].strip() or "x"):
            break  # next section
        if line and not line.startswith(" "):
            current = line.split(" : ")[0].strip()
            attributes[current] = ""
        elif current is not None and line.strip():
            attributes[current] = (attributes[current] + " " + line.strip()).strip()
        i += 1
    return " ".join(" ".join(summary).split()), attributes


def _sections() -> list[tuple[str, type[msgspec.Struct]]]:
    """Every config Struct with its TOML table header, in document order."""
    out: list[tuple[str, type[msgspec.Struct]]] = [("top level", Config)]

    def walk(struct: type[msgspec.Struct], prefix: str) -> None:
        for field in msgspec.structs.fields(struct):
            tp = _strip(field.type)
            name = f"{prefix}{field.encode_name}"
            if typing.get_origin(tp) is tuple and _struct_of(typing.get_args(tp)[0]):
                child = _struct_of(typing.get_args(tp)[0])
                assert child is not None
                out.append((f"[[{name}]]", child))
                walk(child, f"{name}.")
            elif (child := _struct_of(tp)) is not None:
                out.append((f"[{name}]", child))
                walk(child, f"{name}.")

    walk(Config, "")
    return out


def _cell(text: str) -> str:
    """One Markdown table cell: RST literals become Markdown code, pipes are escaped."""
    return text.replace("``", "`").replace("|", "\\|").replace("\n", " ")


def render_markdown() -> str:
    """Render the configuration reference (``docs/configuration.md``) from the Structs.

    One section per Struct, in file order, each with a table of key, type, default,
    constraint and meaning taken from the field annotations, defaults and the class
    docstring's ``Attributes`` section.

    Returns
    -------
    str
        Markdown text ending in a newline.

    Raises
    ------
    RuntimeError
        A field has no ``Attributes`` entry, or an entry names no field (the docs
        would silently drift from the code).
    """
    sections = _sections()
    header_of = {struct: header for header, struct in sections}
    out = [_PREAMBLE]
    for header, struct in sections:
        summary, attributes = _docstring_parts(struct)
        fields = msgspec.structs.fields(struct)
        title = "Top level (`Config`)" if struct is Config else f"`{header}` ({struct.__name__})"
        names = {f.name for f in fields}
        missing = [f.name for f in fields if f.name not in attributes]
        extra = [a for a in attributes if a not in names]
        if missing or extra:
            raise RuntimeError(
                f"{struct.__name__} docstring out of sync: undocumented {missing}, unknown {extra}"
            )
        out.append(f"\n## {title}\n\n{_cell(summary)}\n\n")
        out.append("| key | type | default | constraint | meaning |\n")
        out.append("|---|---|---|---|---|\n")
        for field in fields:
            row = [
                f"`{field.encode_name}`",
                _type_text(field.type),
                _default_text(field, header_of),
                _constraint_text(field.type),
                attributes[field.name],
            ]
            out.append("| " + " | ".join(_cell(c) for c in row) + " |\n")
    return "".join(out)


def _main(argv: Sequence[str]) -> int:
    """``python -m fastroute.config [FILE]``: print the reference, or check FILE."""
    if not argv:
        sys.stdout.write(render_markdown())
        return 0
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m fastroute.config [FILE]", file=sys.stderr)
        print("  no FILE: print docs/configuration.md; FILE: validate it", file=sys.stderr)
        return 2
    try:
        config = load_config(argv[0])
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(
        f"{argv[0]}: ok ({len(config.engines)} engines, {len(config.network.regions)} regions, "
        f"{len(config.tenants)} tenants, {len(config.classes)} classes)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
