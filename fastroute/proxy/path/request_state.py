"""The state of one inference request as it moves along the request path.

One :class:`RequestState` is created per request by
:meth:`~fastroute.proxy.path.handler.InferenceHandler.handle` and handed to every step
(classify, route, forward, relay) instead of a train of parameters. Its stage fields
(``fleet``, ``row``, ``strategy``, ``route``, ``stage``, ``body``, ``sink``) describe the
forward step under way: set once for a whole request, and once per stage (prefill, then
decode) for a P/D request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastroute.config import ClassConfig
from fastroute.policy import Decision, RouteRequest
from fastroute.proxy.http.reply import Sink
from fastroute.proxy.path.decisions import DecisionRecord
from fastroute.proxy.path.requests import ParsedRequest
from fastroute.proxy.path.sse import StreamMeter

if TYPE_CHECKING:
    from fastroute.proxy.path.fleet import Fleet
    from fastroute.proxy.path.migration import Migration
    from fastroute.proxy.path.strategy import RoutingStrategy
    from fastroute.proxy.tracing import RequestTrace

__all__ = ["RequestState"]


@dataclass(slots=True, eq=False)
class RequestState:
    """Everything the request path knows of one request.

    Attributes
    ----------
    request : Incoming
        The request's ``path``, ``headers`` and ``raw_headers``.
    kind : {"chat", "completions", "embeddings"}
        The endpoint.
    body : bytes or None
        The bytes to forward: the client's body, or a P/D stage's own body.
    sink : Sink
        Where a streamed response goes (a P/D prefill stage: nowhere).
    record : DecisionRecord
        The request's decision record (``record.request_id`` is its id).
    loop : asyncio.AbstractEventLoop
        The loop the request is served in (looked up once per handler).
    t0 : float
        Loop time of arrival; timings are seconds from it.
    parsed : ParsedRequest or None
        The minimal parse (None before parsing).
    model, priority, tenant : str
        The classification (``tenant`` is "" without tenants).
    zones : frozenset of str
        Residency zones the request may be served in.
    hardware : str or None
        The tenant's hardware class, if any.
    cls : ClassConfig or None
        The request's class.
    row : int
        The class row in the stage's fleet (``record.row`` keeps the main fleet's).
    slo_ttft_s, slo_tpot_s : float or None
        The request's SLOs (read only by strategies that use them).
    key : int
        The routing key hash.
    strategy : RoutingStrategy or None
        How the stage's fleet is routed (the class's policy over that fleet).
    fleet : Fleet or None
        The fleet of the stage under way.
    route : RouteRequest or None
        What the policy decides on, for the stage under way.
    stage : {"prefill", "decode"} or None
        The P/D stage under way; None for a whole request.
    deadline : float
        Loop time by which the request must be done.
    decision : Decision or None
        The decision the stage's attempts follow (set by ``Forwarder.try_ranked``): its
        ``cached_tokens`` at the chosen engine are not counted as queued prefill.
    unenforced : Decision or None
        The SLO-infeasible decision a not yet calibrated strategy routed anyway.
    strip_usage : bool
        ``body`` asks for the stream's usage event on the client's behalf (it did not):
        the relay measures it and does not pass it on.
    meter_type : callable
        Makes the relay's stream meter from ``strip_usage``: the chat/completions
        :class:`~fastroute.proxy.path.sse.StreamMeter`, or a dialect's
        (:mod:`~fastroute.proxy.path.sse_dialects`).
    api : object or None
        The hooks of a Responses or Messages request
        (:mod:`~fastroute.proxy.path.api_endpoints`); None for the other kinds.
    migration : Migration or None
        The stream's mid-stream migration state (None: it is never migrated).
    hedge : object or None
        The leg of a hedged race this state copy is (:mod:`~fastroute.proxy.path.hedge`):
        told of the stream's first token; None outside a race.
    trace : RequestTrace or None
        The request's spans (:mod:`fastroute.proxy.tracing`); None when tracing is off.
    tenant_admission : TenantAdmission or None
        The tenant-limit charge to give back when the request ends (None: not counted).
    """

    request: Any
    kind: str
    body: bytes | None
    sink: Sink
    record: DecisionRecord
    loop: asyncio.AbstractEventLoop
    t0: float
    parsed: ParsedRequest | None = None
    model: str = ""
    priority: str = ""
    tenant: str = ""
    zones: frozenset[str] = frozenset()
    hardware: str | None = None
    cls: ClassConfig | None = None
    row: int = -1
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    key: int = 0
    strategy: RoutingStrategy | None = None
    fleet: Fleet | None = None
    route: RouteRequest | None = None
    stage: str | None = None
    deadline: float = 0.0
    decision: Decision | None = None
    unenforced: Decision | None = None
    strip_usage: bool = False
    meter_type: Callable[[bool], StreamMeter] = StreamMeter
    api: Any = None
    migration: Migration | None = None
    hedge: Any = None
    trace: RequestTrace | None = None
    tenant_admission: Any = None
