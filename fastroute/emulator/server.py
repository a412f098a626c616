"""vLLM-compatible emulated engines on aiohttp: one port per engine, many engines per process.

Each :class:`EmulatedEngine` owns an :class:`~fastroute.emulator.model.EngineModel`
and one asyncio task that runs the model's step loop on the wall clock
(``loop.time()``): start a step, sleep until it ends, deliver its tokens, repeat.
Handlers never compute latency themselves; they wait on their request's
:class:`TokenChannel` and write what the step loop delivered.

Endpoints (per engine)
----------------------
``POST /v1/chat/completions``, ``POST /v1/completions``
    JSON or SSE (``stream: true``), OpenAI chunk format, ``stream_options.include_usage``,
    ``usage.prompt_tokens_details.cached_tokens``, ``max_tokens`` /
    ``max_completion_tokens``, ``min_tokens``, ``ignore_eos``, ``n = 1``, vLLM's
    ``kv_transfer_params`` (disaggregated prefill/decode), and for ``kind = "sglang"``
    P/D engines SGLang's ``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room``.
``POST /v1/responses``, ``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``
    vLLM's Responses API (:mod:`fastroute.emulator.responses_api`).
``POST /v1/messages``, ``POST /v1/messages/count_tokens``
    vLLM's Anthropic Messages API (:mod:`fastroute.emulator.messages_api`).
``GET /v1/models`` (the model with its ``max_model_len``, then each of
``EngineSpec.lora_adapters`` with the model as ``parent``), ``GET /health`` (503 while
loading or draining), ``GET /metrics``.
``POST /tokenize``, ``/detokenize``, ``/pooling``, ``/classify``, ``/score`` (+ ``/v1/``),
``/rerank`` (+ ``/v1/``, ``/v2/``), ``/v1/audio/transcriptions``, ``/v1/audio/translations``:
    vLLM 0.32's shapes, answered at once (:mod:`fastroute.emulator.extra_api`).
``GET|POST|DELETE /admin/fault`` (loopback only): see :mod:`fastroute.emulator.faults`.
``POST /internal/kv_transfer/claim`` (loopback only): a decode engine in another
    process claims KV held by this (prefill) engine.
``POST /bootstrap/claim`` (loopback only; an SGLang prefill engine also serves it on its
    bootstrap port): a decode engine waits for the KV of a ``bootstrap_room``
    (:mod:`fastroute.emulator.bootstrap`).

Bounds: request bodies over ``max_body_bytes`` get 413; a full waiting queue
(``EngineConfig.max_waiting``) gets 429 with ``Retry-After: 1``; hung requests
count against the same bound. A request's channel holds a count of undelivered
tokens, not the tokens, so a slow reader costs O(1) memory (vLLM's output
collector merges undelivered outputs the same way).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import ClientError, ClientSession, ClientTimeout, web

from fastroute.emulator.bootstrap import DEFAULT_BOOTSTRAP_TIMEOUT_S, BootstrapRooms, RoomFailed
from fastroute.emulator.extra_api import add_extra_routes
from fastroute.emulator.faults import FaultController, FaultState, FaultUpdate
from fastroute.emulator.messages_api import MessagesAPI
from fastroute.emulator.metrics import EngineMetrics
from fastroute.emulator.model import (
    EngineConfig,
    EngineModel,
    OutputLengthDistribution,
    QueueFullError,
    Request,
    RequestTooLongError,
)
from fastroute.emulator.output_text import OutputText, continued_output, prompt_seed
from fastroute.emulator.profiles import true_profile
from fastroute.emulator.protocol import (
    SSE_DONE,
    ChunkEncoder,
    CompletionRequest,
    RequestError,
    decode_chat,
    decode_completion,
    error_body,
    stream_error_event,
    usage_dict,
)
from fastroute.emulator.responses_api import ResponsesAPI
from fastroute.hardware import get_profile
from fastroute.tokens import TokenizedPrompt, render_chat, tokenize_ids, tokenize_text

__all__ = [
    "EngineSpec",
    "EmulatedEngine",
    "EmulatedFleet",
    "TokenChannel",
    "fleet_specs",
    "ROLES",
    "KINDS",
    "DEFAULT_MODEL_NAME",
]

logger = logging.getLogger(__name__)

ROLES = ("both", "prefill", "decode")
#: Engine software the emulator can behave like (``/metrics`` dialect, error shape, reasoning).
KINDS = ("vllm", "sglang", "llamacpp")
#: The delta field of reasoning tokens, per kind.
REASONING_FIELD = {
    "vllm": "reasoning",
    "sglang": "reasoning_content",
    "llamacpp": "reasoning_content",
}
DEFAULT_MODEL_NAME = "meta-llama/Meta-Llama-3-8B-Instruct"
_LOOPBACK = frozenset({"127.0.0.1", "::1"})
#: A step may start at the previous step's end (not "now") if the loop woke this late:
#: back-to-back steps on a GPU have no gap, and timer lateness must not accumulate.
LATE_TOLERANCE_S = 0.005
_CLAIM_TIMEOUT = ClientTimeout(total=2.0)
#: Slack on top of the wait for the bootstrap request itself (connect, answer).
_BOOTSTRAP_HTTP_SLACK_S = 2.0

#: Engines of this process by engine id, so a decode engine claims KV without HTTP.
_LOCAL_ENGINES: weakref.WeakValueDictionary[str, EmulatedEngine] = weakref.WeakValueDictionary()


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """Everything needed to start one emulated engine.

    Attributes
    ----------
    name : str
        Engine name (log lines, ``fastroute_emulator_info``, response header).
    model_name : str
        Served model name (``/v1/models``, the ``model`` field, metric label).
    profile : str
        Hardware profile (:data:`~fastroute.hardware.PROFILES`): the engine's
        name for its hardware (``/metrics``), and its datasheet step times.
    step_time_factors : mapping of str to float
        The engine's *true* step times: the profile's coefficients scaled by these
        (:func:`~fastroute.emulator.profiles.true_profile`; e.g. ``{"b0_s": 1.5}``).
        The profile name is kept, so a router configured with it starts from the
        datasheet constants while the engine runs the true ones.
    role : {"both", "prefill", "decode"}
        ``prefill`` engines refuse ``do_remote_prefill``; ``decode`` engines
        refuse ``do_remote_decode``; all serve plain requests.
    region : str
        Free-form label exposed in ``fastroute_emulator_info``.
    seed : int
        Seeds output lengths and random faults.
    host, port : str, int
        Listening address; port 0 picks an ephemeral port.
    config : EngineConfig
        Scheduler/cache settings.
    faults : FaultState
        Faults active from the start.
    metrics_compat : {"current", "legacy", "both"}
        vLLM metric-name generation.
    max_body_bytes : int
        Larger request bodies get 413.
    load_time_s : float
        ``/health`` answers 503 (and requests 503) for this long after start.
    output_lengths : OutputLengthDistribution
        Output lengths of requests without ``ignore_eos``.
    kind : {"vllm", "sglang", "llamacpp"}
        Which engine to behave like: its ``/metrics`` dialect (``vllm:*``, ``sglang:*``,
        ``llamacpp:*``; ``metrics_compat`` applies to vLLM's), its error shape (SGLang's is
        flat) and its reasoning delta field (vLLM ``reasoning``, the others
        ``reasoning_content``); llama.cpp engines also answer ``return_progress``.
    stream_interval : int
        Tokens per SSE event (vLLM's ``--stream-interval``; a request's ``stream_interval``
        overrides it): the first token goes alone, then one event per ``stream_interval``
        tokens, the last event with what is left.
    final_empty_delta : bool
        A request that ends on ``stop`` ends on an end-of-sequence token whose text is empty,
        as real engines' do: with one token per event the last event is an empty delta
        carrying the ``finish_reason``. Off by default (the emulator's "stop" token has text).
    prompt_tokens_details : bool
        ``usage.prompt_tokens_details.cached_tokens`` in responses. On by default; a real vLLM
        reports it only when started with ``--enable-prompt-tokens-details`` (else the field
        is null).
    reasoning_tokens : int
        The first this many output tokens of a chat response are reasoning (``delta.reasoning``
        or ``reasoning_content``; ``message.reasoning``... in JSON), the rest content.
    bootstrap_port : int
        ``kind = "sglang"``, ``role = "prefill"``: the port of the bootstrap listener decode
        engines reach it on (0: an ephemeral port, see ``EmulatedEngine.bootstrap_port``).
    bootstrap_timeout_s : float
        ``kind = "sglang"``, ``role = "decode"``: how long a request waits for the prefill of
        its ``bootstrap_room`` before it fails (500).
    lora_adapters : tuple of str
        LoRA adapter names the engine lists in ``/v1/models`` (``parent``: ``model_name``) and
        accepts as ``model`` on the endpoints of :mod:`fastroute.emulator.extra_api`.
    tracer_provider : TracerProvider or None
        An OpenTelemetry tracer provider: the engine makes one ``llm_request`` span per
        inference request, a child of its ``traceparent``
        (:mod:`fastroute.emulator.tracing`). None: no spans.
    """

    name: str = "engine-0"
    model_name: str = DEFAULT_MODEL_NAME
    profile: str = "a40"
    step_time_factors: Mapping[str, float] = field(default_factory=dict)
    role: str = "both"
    region: str = ""
    seed: int = 0
    host: str = "127.0.0.1"
    port: int = 0
    config: EngineConfig = field(default_factory=EngineConfig)
    faults: FaultState = field(default_factory=FaultState)
    metrics_compat: str = "current"
    max_body_bytes: int = 4 * 1024 * 1024
    load_time_s: float = 0.0
    output_lengths: OutputLengthDistribution = field(default_factory=OutputLengthDistribution)
    kind: str = "vllm"
    stream_interval: int = 1
    final_empty_delta: bool = False
    prompt_tokens_details: bool = True
    reasoning_tokens: int = 0
    bootstrap_port: int = 0
    bootstrap_timeout_s: float = DEFAULT_BOOTSTRAP_TIMEOUT_S
    lora_adapters: tuple[str, ...] = ()
    tracer_provider: Any = None


class TokenChannel:
    """Delivery mailbox of one request: a count of undelivered tokens plus end flags.

    The step loop calls :meth:`push` / :meth:`finish`; the handler awaits
    :meth:`wait` then :meth:`take`. Its size never grows with the backlog.
    """

    __slots__ = ("pending", "finished", "aborted", "block_ids", "_waiter")

    def __init__(self) -> None:
        self.pending = 0
        self.finished = False
        self.aborted = False
        self.block_ids: list[int] | None = None
        self._waiter: asyncio.Future[None] | None = None

    def push(self) -> None:
        """One more token is available."""
        self.pending += 1
        self._wake()

    def finish(self) -> None:
        """The last token has been pushed."""
        self.finished = True
        self._wake()

    def abort(self) -> None:
        """The engine is going away: the handler must drop the connection."""
        self.aborted = True
        self._wake()

    def take(self) -> int:
        """Return and reset the number of undelivered tokens."""
        n, self.pending = self.pending, 0
        return n

    async def wait(self) -> None:
        """Return once there is a token, the end, or an abort."""
        if self.pending or self.finished or self.aborted:
            return
        self._waiter = asyncio.get_running_loop().create_future()
        await self._waiter

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)


class _Abort(Exception):
    """Drop the client connection without a response (crash fault, engine stop)."""


class EmulatedEngine:
    """One emulated vLLM engine: model, step loop, HTTP app and listener.

    Parameters
    ----------
    spec : EngineSpec
        What to run.

    Examples
    --------
    >>> async def main():                                    # doctest: +SKIP
    ...     engine = EmulatedEngine(EngineSpec(profile="h100"))
    ...     await engine.start()
    ...     print(engine.url)
    ...     await engine.stop()
    """

    def __init__(self, spec: EngineSpec) -> None:
        if spec.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {spec.role!r}")
        if spec.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {spec.kind!r}")
        if spec.stream_interval < 1 or spec.reasoning_tokens < 0:
            raise ValueError(
                f"stream_interval must be >= 1 and reasoning_tokens >= 0, got "
                f"{spec.stream_interval} and {spec.reasoning_tokens}"
            )
        self.spec = spec
        self.name = spec.name
        self.engine_id = f"{spec.name}-{uuid.uuid4().hex[:12]}"
        self.profile = true_profile(get_profile(spec.profile), spec.step_time_factors)
        self.model = EngineModel(self.profile, spec.config, seed=spec.seed)
        self.faults = FaultController(spec.name, spec.faults, seed=spec.seed)
        self.model.slowdown = self.faults.state.slowdown
        self.metrics = EngineMetrics(
            spec.model_name,
            self.model,
            self.faults,
            compat=spec.metrics_compat,
            kind=spec.kind,
            info={
                "engine_name": spec.name,
                "profile": self.profile.name,
                "step_time_factors": ",".join(
                    f"{k}={float(v):g}" for k, v in sorted(spec.step_time_factors.items())
                ),
                "role": spec.role,
                "region": spec.region,
            },
        )
        self.port = spec.port
        #: ``/v1/responses`` (stored responses by id) and ``/v1/messages``.
        self.responses_api = ResponsesAPI(self)
        self.messages_api = MessagesAPI(self)
        self.app = self._make_app()
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._step_task: asyncio.Task[None] | None = None
        self._reopen_task: asyncio.Task[None] | None = None
        self._wakeup = asyncio.Event()
        self._channels: set[TokenChannel] = set()
        self._hung: set[asyncio.Future[None]] = set()
        self._ready_at_s = 0.0
        self._stopping = False
        self._last_submit_s = -math.inf
        self._next_block_id = 0
        self._session: ClientSession | None = None
        self._created = int(time.time())
        #: SGLang P/D: the bootstrap rooms of a prefill engine, and its bootstrap port.
        self.rooms = BootstrapRooms()
        self.bootstrap_port: int | None = None

    @property
    def bootstrap(self) -> bool:
        """Whether this engine speaks SGLang's P/D protocol (bootstrap rooms)."""
        return self.spec.kind == "sglang" and self.spec.role != "both"

    # -- lifecycle -----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8100``."""
        return f"http://{self.spec.host}:{self.port}"

    @property
    def listening(self) -> bool:
        """False while the refuse-connections fault holds the listener closed."""
        return self._site is not None

    async def start(self) -> None:
        """Bind the listener and start the step loop."""
        loop = asyncio.get_running_loop()
        self._runner = web.AppRunner(
            self.app,
            access_log=None,
            handle_signals=False,
            handler_cancellation=True,
            shutdown_timeout=2.0,
        )
        await self._runner.setup()
        self._ready_at_s = loop.time() + self.spec.load_time_s
        self._step_task = asyncio.create_task(self._step_loop(), name=f"engine-{self.name}-steps")
        _LOCAL_ENGINES[self.engine_id] = self
        if self.bootstrap and self.spec.role == "prefill":
            site = web.TCPSite(self._runner, self.spec.host, self.spec.bootstrap_port)
            await site.start()
            self.bootstrap_port = site.port
        if self.faults.state.refuse_connections:
            await self._bind()  # learn the port (maybe ephemeral), then close it as asked
        await self._sync_listener()
        logger.info(
            "engine %s (%s, %s) on %s%s",
            self.name,
            self.profile.name,
            self.spec.role,
            self.url,
            "" if self.bootstrap_port is None else f", bootstrap port {self.bootstrap_port}",
        )

    async def stop(self) -> None:
        """Stop: drop in-flight requests, close the listener and every connection."""
        if self._stopping:
            return
        self._stopping = True
        _LOCAL_ENGINES.pop(self.engine_id, None)
        for task in (self._reopen_task, self._step_task):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        for ch in list(self._channels):
            ch.abort()
        for fut in list(self._hung):
            if not fut.done():
                fut.set_result(None)
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()
        self._site = None

    # -- faults --------------------------------------------------------------------------------
    async def set_faults(self, **changes: Any) -> FaultState:
        """Change faults live (keyword = :class:`FaultState` field); return the new state."""
        state = self.faults.apply(changes)
        self.model.slowdown = state.slowdown
        await self._sync_listener()
        return state

    async def clear_faults(self) -> FaultState:
        """Turn every fault off (reopens a closed listener)."""
        state = self.faults.clear()
        self.model.slowdown = state.slowdown
        await self._sync_listener()
        return state

    async def _sync_listener(self) -> None:
        state = self.faults.state
        if not state.refuse_connections:
            if self._reopen_task is not None and self._reopen_task is not asyncio.current_task():
                self._reopen_task.cancel()
            self._reopen_task = None
            if self._site is None and not self._stopping:
                await self._bind()
            return
        if self._site is not None:
            await self._site.stop()
            self._site = None
            # Pooled keep-alive connections would still reach a "dead" engine: drop them too.
            assert self._runner is not None and self._runner.server is not None
            for proto in self._runner.server.connections:
                proto.close()
        if state.refuse_for_s is not None and self._reopen_task is None:
            self._reopen_task = asyncio.create_task(self._reopen_after(state.refuse_for_s))

    async def _reopen_after(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        self._reopen_task = None
        await self.set_faults(refuse_connections=False, refuse_for_s=None)

    async def _bind(self) -> None:
        assert self._runner is not None
        site = web.TCPSite(self._runner, self.spec.host, self.port, reuse_address=True)
        await site.start()
        self._site = site
        self.port = site.port

    # -- step loop -----------------------------------------------------------------------------
    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        model = self.model
        wakeup = self._wakeup
        try:
            while True:
                now = loop.time()
                t = model.next_step_time(now)
                if t is None or t > now:
                    wakeup.clear()
                    if t is None:
                        await wakeup.wait()
                    else:
                        try:
                            async with asyncio.timeout(t - now):
                                await wakeup.wait()
                        except TimeoutError:
                            pass
                    continue
                anchor = max(model.busy_until_s, self._last_submit_s)
                start = anchor if 0.0 <= now - anchor < LATE_TOLERANCE_S else now
                result = model.step(start)
                delay = result.end_s - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                self._deliver(result.emitted, result.finished)
        except asyncio.CancelledError:
            raise
        except Exception:
            # A model bug must not leave clients waiting forever: fail them all, loudly.
            logger.exception("engine %s: step loop failed; dropping all requests", self.name)
            for ch in list(self._channels):
                ch.abort()
            self._stopping = True

    def _deliver(self, emitted: list[Request], finished: list[Request]) -> None:
        met = self.metrics
        for req in emitted:
            if req.num_output == 1:
                met.ttft.observe(req.first_token_s - req.arrival_s)  # type: ignore[operator]
                met.queue.observe(req.scheduled_s - req.arrival_s)  # type: ignore[operator]
            elif req.last_itl_s is not None:
                met.itl.observe(req.last_itl_s)
            if req.data is not None:
                req.data.push()
        for req in finished:
            met.e2e.observe(req.finish_s - req.arrival_s)  # type: ignore[operator]
            if req.data is not None:
                req.data.finish()

    # -- HTTP ----------------------------------------------------------------------------------
    def _make_app(self) -> web.Application:
        # +1 so that aiohttp's own limit never fires first: we answer 413 in vLLM's shape.
        app = web.Application(client_max_size=self.spec.max_body_bytes + 1)
        if self.spec.tracer_provider is not None:
            from fastroute.emulator.tracing import engine_span_middleware

            spec = self.spec
            app.middlewares.append(
                engine_span_middleware(spec.tracer_provider, spec.name, spec.model_name)
            )
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/admin/fault", self._get_fault)
        app.router.add_post("/admin/fault", self._post_fault)
        app.router.add_delete("/admin/fault", self._delete_fault)
        app.router.add_post("/internal/kv_transfer/claim", self._claim_endpoint)
        app.router.add_post("/bootstrap/claim", self._bootstrap_endpoint)
        self.responses_api.install(app)
        self.messages_api.install(app)
        add_extra_routes(app, self)
        return app

    def _error(self, status: int, message: str, param: str | None = None) -> web.Response:
        headers = {"x-fastroute-engine": self.name}
        if status == 429:
            headers["Retry-After"] = "1"
        return web.Response(
            status=status,
            body=error_body(status, message, param, flat=self.spec.kind == "sglang"),
            content_type="application/json",
            headers=headers,
        )

    def _unavailable(self) -> str | None:
        if self._stopping:
            return "engine is shutting down"
        if asyncio.get_running_loop().time() < self._ready_at_s:
            return "engine is loading the model"
        if self.faults.state.drain:
            return "engine is draining"
        return None

    async def _health(self, request: web.Request) -> web.Response:
        reason = self._unavailable()
        if reason is not None:
            return self._error(503, reason)
        return web.Response(status=200)

    async def _models(self, request: web.Request) -> web.Response:
        name = self.spec.model_name
        card = {
            "id": name,
            "object": "model",
            "created": self._created,
            "owned_by": "vllm",
            "root": name,
            "parent": None,
            "max_model_len": self.model.max_model_len,
        }
        adapters = [
            {**card, "id": lora, "root": f"/adapters/{lora}", "parent": name}
            for lora in self.spec.lora_adapters
        ]
        return web.json_response({"object": "list", "data": [card, *adapters]}, dumps=_dumps)

    async def _metrics(self, request: web.Request) -> web.Response:
        delay = self.faults.state.metrics_delay_s
        if delay > 0:
            await asyncio.sleep(delay)
        return web.Response(
            body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"}
        )

    def _admin_allowed(self, request: web.Request) -> bool:
        return request.remote in _LOOPBACK

    async def _get_fault(self, request: web.Request) -> web.Response:
        if not self._admin_allowed(request):
            return self._error(403, "admin endpoints accept loopback clients only")
        return web.Response(
            body=msgspec.json.encode(self.faults.state), content_type="application/json"
        )

    async def _post_fault(self, request: web.Request) -> web.Response:
        if not self._admin_allowed(request):
            return self._error(403, "admin endpoints accept loopback clients only")
        try:
            update = msgspec.json.decode(await request.read(), type=FaultUpdate)
            changes = update.changes()
            if changes.get("refuse_connections") and changes.get("refuse_for_s") is None:
                # Over HTTP, an open-ended refusal would lock the admin endpoint out with it.
                raise ValueError("refuse_connections over HTTP needs refuse_for_s")
            state = await self.set_faults(**changes)
        except (msgspec.DecodeError, ValueError) as exc:
            return self._error(400, f"invalid fault update: {exc}")
        return web.Response(body=msgspec.json.encode(state), content_type="application/json")

    async def _delete_fault(self, request: web.Request) -> web.Response:
        if not self._admin_allowed(request):
            return self._error(403, "admin endpoints accept loopback clients only")
        state = await self.clear_faults()
        return web.Response(body=msgspec.json.encode(state), content_type="application/json")

    # -- P/D KV transfer -----------------------------------------------------------------------
    def claim_local(self, request_id: str, block_ids: list[int]) -> int:
        """Release KV held for ``request_id`` to a decode engine; return its prompt length.

        Raises
        ------
        KeyError
            Unknown, already claimed or expired transfer, or block ids that do not match.
        """
        now = asyncio.get_running_loop().time()
        held = self.model.held(request_id, now)
        if held is None or held.data is None or held.data.block_ids != block_ids:
            raise KeyError(request_id)
        return self.model.claim_transfer(request_id, now).num_prompt_tokens

    async def _claim_endpoint(self, request: web.Request) -> web.Response:
        if not self._admin_allowed(request):
            return self._error(403, "internal endpoints accept loopback clients only")
        try:
            body = msgspec.json.decode(await request.read(), type=dict[str, Any])
            n = self.claim_local(str(body["remote_request_id"]), list(body["remote_block_ids"]))
        except (msgspec.DecodeError, KeyError, TypeError):
            return self._error(404, "unknown or expired KV transfer")
        return web.json_response({"num_prompt_tokens": n})

    async def _claim_remote(self, params: dict[str, Any], num_prompt_tokens: int) -> None:
        """Decode side: claim the KV named by ``params``; raise :class:`RequestError` if invalid."""
        fields = {
            "remote_engine_id": str,
            "remote_request_id": str,
            "remote_block_ids": list,
            "remote_host": str,
            "remote_port": int,
        }
        for name, kind in fields.items():
            if not isinstance(params.get(name), kind):
                raise RequestError(
                    400,
                    f"kv_transfer_params.{name} is missing or not a {kind.__name__}",
                    "kv_transfer_params",
                )
        engine_id = params["remote_engine_id"]
        request_id = params["remote_request_id"]
        block_ids = params["remote_block_ids"]
        unknown = RequestError(
            400,
            f"KV transfer {request_id!r} from engine {engine_id!r} is unknown or expired",
            "kv_transfer_params",
        )
        local = _LOCAL_ENGINES.get(engine_id)
        if local is not None:
            try:
                n = local.claim_local(request_id, block_ids)
            except KeyError:
                raise unknown from None
        else:
            if self._session is None:
                self._session = ClientSession(timeout=_CLAIM_TIMEOUT)
            url = (
                f"http://{params['remote_host']}:{params['remote_port']}/internal/kv_transfer/claim"
            )
            try:
                async with self._session.post(
                    url, json={"remote_request_id": request_id, "remote_block_ids": block_ids}
                ) as resp:
                    if resp.status != 200:
                        raise unknown
                    n = int((await resp.json())["num_prompt_tokens"])
            except (ClientError, TimeoutError, KeyError, ValueError):
                raise unknown from None
        if n != num_prompt_tokens:
            raise RequestError(
                400,
                f"KV transfer {request_id!r} holds {n} prompt tokens; this prompt has "
                f"{num_prompt_tokens}",
                "kv_transfer_params",
            )

    # -- SGLang P/D bootstrap -------------------------------------------------------------------
    async def _bootstrap_endpoint(self, request: web.Request) -> web.Response:
        """Prefill side: wait for the room's prefill, release its KV to the decode engine."""
        if not self._admin_allowed(request):
            return self._error(403, "internal endpoints accept loopback clients only")
        try:
            body = msgspec.json.decode(await request.read(), type=dict[str, Any])
            room, timeout_s = int(body["bootstrap_room"]), float(body["timeout_s"])
        except (msgspec.DecodeError, KeyError, TypeError, ValueError):
            return self._error(400, "expected {bootstrap_room, timeout_s}")
        if not self.bootstrap or self.spec.role != "prefill":
            return self._error(404, f"engine {self.name} is not an SGLang prefill engine")
        try:
            request_id = await self.rooms.wait(room, timeout_s)
        except RoomFailed as exc:
            return self._error(404, str(exc), "bootstrap_room")
        now = asyncio.get_running_loop().time()
        if self.model.held(request_id, now) is None:
            return self._error(404, f"the KV of bootstrap_room {room} expired", "bootstrap_room")
        n = self.model.claim_transfer(request_id, now).num_prompt_tokens
        return web.json_response({"num_prompt_tokens": n})

    def _bootstrap_room(self, parsed: Any) -> int | None:
        """The request's room on an SGLang P/D engine (400 without one); None elsewhere."""
        if not self.bootstrap:
            return None
        room = parsed.bootstrap_room
        if room is None or isinstance(room, bool) or not 0 <= room < 2**64:
            raise RequestError(
                400,
                f"this engine is an SGLang {self.spec.role} server (disaggregation mode): "
                "a request needs a bootstrap_room (an integer shared with its "
                f"{'decode' if self.spec.role == 'prefill' else 'prefill'} request)",
                "bootstrap_room",
            )
        if self.spec.role == "decode" and (
            not isinstance(parsed.bootstrap_host, str) or not isinstance(parsed.bootstrap_port, int)
        ):
            raise RequestError(
                400, "a decode request needs bootstrap_host and bootstrap_port", "bootstrap_host"
            )
        return room

    async def _bootstrap_claim(self, parsed: Any, room: int, num_prompt_tokens: int) -> None:
        """Decode side: wait (bounded) for the room's prefill on its engine, take the KV."""
        if self._session is None:
            self._session = ClientSession(timeout=_CLAIM_TIMEOUT)
        wait_s = self.spec.bootstrap_timeout_s
        url = f"http://{parsed.bootstrap_host}:{parsed.bootstrap_port}/bootstrap/claim"
        why = ""
        try:
            async with self._session.post(
                url,
                json={"bootstrap_room": room, "timeout_s": wait_s},
                timeout=ClientTimeout(total=wait_s + _BOOTSTRAP_HTTP_SLACK_S),
            ) as resp:
                answer = await resp.json(content_type=None)
                if resp.status == 200:
                    n = int(answer["num_prompt_tokens"])
                else:
                    why = str(answer.get("message", resp.status))
        except (ClientError, TimeoutError, KeyError, ValueError, TypeError, AttributeError) as exc:
            why = f"bootstrap server {parsed.bootstrap_host}:{parsed.bootstrap_port}: {exc!r}"
        if why:
            raise RequestError(500, f"KV transfer of bootstrap_room {room} failed: {why}")
        if n != num_prompt_tokens:
            raise RequestError(
                400,
                f"bootstrap_room {room} holds {n} prompt tokens; this prompt has "
                f"{num_prompt_tokens}",
                "bootstrap_room",
            )

    # -- generation ----------------------------------------------------------------------------
    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        reason = self._unavailable()
        if reason is not None:
            return self._error(503, reason)
        injected = self.faults.draw_error()
        if injected is not None:
            return self._error(injected, f"injected fault: engine {self.name} fails this request")
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return self._error(
                413, f"request body exceeds the limit of {self.spec.max_body_bytes} bytes"
            )
        if len(body) > self.spec.max_body_bytes:
            return self._error(
                413, f"request body exceeds the limit of {self.spec.max_body_bytes} bytes"
            )
        room: int | None = None
        try:
            parsed = decode_chat(body) if chat else decode_completion(body)
            room = self._bootstrap_room(parsed)
            if parsed.model is not None and parsed.model != self.spec.model_name:
                raise RequestError(404, f"The model `{parsed.model}` does not exist.", "model")
            prompt = self._tokenize(parsed, chat)
            if room is None:
                hold_kv, remote = self._pd_mode(parsed.kv_transfer_params)
            else:
                hold_kv, remote = self.spec.role == "prefill", self.spec.role == "decode"
            output_tokens, finish_reason = self._output_length(parsed, prompt, hold_kv)
            if room is not None and hold_kv:
                output_tokens, finish_reason = 1, "length"  # SGLang's prefill: one token
            if remote and room is not None:
                await self._bootstrap_claim(parsed, room, prompt.num_tokens)
            elif remote:
                await self._claim_remote(parsed.kv_transfer_params or {}, prompt.num_tokens)
        except RequestError as exc:
            return self._error(exc.status, exc.message, exc.param)

        if self.faults.state.hang:
            return await self._hang(request)

        prefix = "chatcmpl" if chat else "cmpl"
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        channel = TokenChannel()
        mreq = Request(
            response_id,
            prompt.num_tokens,
            prompt.block_hashes,
            output_tokens=output_tokens,
            finish_reason=finish_reason,
            remote_prefill=remote,
            hold_kv=hold_kv,
            data=channel,
        )
        now = asyncio.get_running_loop().time()
        try:
            self.model.submit(mreq, now)
        except QueueFullError as exc:
            return self._error(429, f"engine {self.name} is overloaded: {exc}")
        except RequestTooLongError as exc:
            return self._error(400, str(exc))
        self._last_submit_s = now
        self._wakeup.set()
        self._channels.add(channel)
        output = _output_text(parsed, chat)
        try:
            if parsed.stream:
                reply = await self._stream(request, parsed, mreq, chat, response_id, output)
            else:
                reply = await self._complete(request, parsed, mreq, chat, response_id, output)
            if room is not None and hold_kv and channel.finished:
                self.rooms.held(room, response_id)  # the decode of this room may take the KV
            return reply
        except _Abort:
            transport = request.transport
            if transport is not None:
                transport.abort()
            # The connection is gone; raising keeps aiohttp from writing a response into it.
            raise asyncio.CancelledError() from None
        finally:
            self._channels.discard(channel)
            if not channel.finished:
                self.model.cancel(response_id)

    def _tokenize(self, parsed: Any, chat: bool) -> TokenizedPrompt:
        try:
            if chat:
                return tokenize_text(
                    render_chat(
                        parsed.messages,
                        add_generation_prompt=parsed.add_generation_prompt,
                        continue_final_message=parsed.continue_final_message,
                    )
                )
            assert isinstance(parsed, CompletionRequest)
            if isinstance(parsed.prompt, str):
                return tokenize_text(parsed.prompt)
            return tokenize_ids(parsed.prompt)  # type: ignore[arg-type]
        except ValueError as exc:
            raise RequestError(400, str(exc), "messages" if chat else "prompt") from None

    def _pd_mode(self, params: dict[str, Any] | None) -> tuple[bool, bool]:
        """(hold KV for a decode engine, receive KV from a prefill engine)."""
        if not params:
            return False, False
        if params.get("do_remote_decode"):
            if self.spec.role == "decode":
                raise RequestError(
                    400,
                    "this engine is a decode engine: do_remote_decode is not accepted",
                    "kv_transfer_params",
                )
            return True, False
        if params.get("do_remote_prefill"):
            if self.spec.role == "prefill":
                raise RequestError(
                    400,
                    "this engine is a prefill engine: do_remote_prefill is not accepted",
                    "kv_transfer_params",
                )
            return False, True
        return False, False

    def _output_length(
        self, parsed: Any, prompt: TokenizedPrompt, hold_kv: bool
    ) -> tuple[int, str]:
        max_len = self.model.max_model_len
        if prompt.num_tokens >= max_len:
            raise RequestError(
                400,
                f"This model's maximum context length is {max_len} tokens. However, your "
                f"request has {prompt.num_tokens} input tokens. Please reduce the length of "
                "the input messages.",
            )
        cap = parsed.max_tokens if parsed.max_tokens is not None else max_len - prompt.num_tokens
        try:
            self.model.check(prompt.num_tokens, cap)
        except RequestTooLongError as exc:
            raise RequestError(400, str(exc)) from None
        if parsed.ignore_eos or hold_kv:
            return cap, "length"
        drawn = max(parsed.min_tokens, self.spec.output_lengths.sample(self.model.rng))
        if drawn >= cap:
            return cap, "length"
        return drawn, "stop"

    async def _hang(self, request: web.Request) -> web.StreamResponse:
        if len(self._hung) >= self.model.config.max_waiting:
            return self._error(429, f"engine {self.name} is overloaded: too many hung requests")
        self.faults.injected_total["hang"] += 1
        fut = asyncio.get_running_loop().create_future()
        self._hung.add(fut)
        try:
            await fut  # resolved only when the engine stops
        finally:
            self._hung.discard(fut)
        raise _Abort

    def _crash_due(self, given: int) -> bool:
        limit = self.faults.state.crash_after_tokens
        if limit is not None and given >= limit:
            self.faults.injected_total["crash"] += 1
            return True
        return False

    def _final_extra(self, mreq: Request) -> dict[str, Any] | None:
        if not mreq.hold_kv or self.bootstrap:
            return None  # SGLang's decode finds the KV by bootstrap_room, not in the answer
        block_ids = list(range(self._next_block_id, self._next_block_id + mreq.num_blocks_held))
        self._next_block_id += len(block_ids)
        mreq.data.block_ids = block_ids
        return {
            "kv_transfer_params": {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": block_ids,
                "remote_engine_id": self.engine_id,
                "remote_request_id": mreq.request_id,
                "remote_host": self.spec.host,
                "remote_port": self.port,
                "tp_size": 1,
            }
        }

    def _token_text(self, output: OutputText, index: int, mreq: Request) -> str:
        """Output token ``index``'s text; the end-of-sequence token of a ``stop`` is empty."""
        if (
            self.spec.final_empty_delta
            and mreq.finish_reason == "stop"
            and index == mreq.output_tokens - 1
        ):
            return ""
        return output.token(index)

    def _usage(self, mreq: Request, completion_tokens: int) -> dict[str, Any]:
        cached = mreq.num_cached_tokens if self.spec.prompt_tokens_details else None
        return usage_dict(mreq.num_prompt_tokens, completion_tokens, cached)

    def _stream_error_due(self, given: int) -> bool:
        limit = self.faults.state.stream_error_after_tokens
        if limit is not None and given >= limit:
            self.faults.injected_total["stream_error"] += 1
            return True
        return False

    async def _complete(
        self,
        request: web.Request,
        parsed: Any,
        mreq: Request,
        chat: bool,
        response_id: str,
        output: OutputText,
    ) -> web.Response:
        channel: TokenChannel = mreq.data
        given = 0
        while True:
            if self._crash_due(given):
                raise _Abort
            if self._stream_error_due(given):
                return self._error(500, _STREAM_ERROR_MESSAGE)
            await channel.wait()
            if channel.aborted:
                raise _Abort
            given += channel.take()
            if channel.finished:
                break
        texts = [self._token_text(output, i, mreq) for i in range(given)]
        continuing = chat and parsed.continue_final_message
        thinking = min(self.spec.reasoning_tokens, given) if chat and not continuing else 0
        text = "".join(texts[thinking:])
        choice: dict[str, Any] = {"index": 0}
        if chat:
            choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
            if thinking:
                choice["message"][REASONING_FIELD[self.spec.kind]] = "".join(texts[:thinking])
        else:
            choice["text"] = text
        choice.update(logprobs=None, finish_reason=mreq.finish_reason, stop_reason=None)
        body: dict[str, Any] = {
            "id": response_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.spec.model_name,
            "choices": [choice],
            "usage": self._usage(mreq, given),
        }
        extra = self._final_extra(mreq)
        if extra:
            body.update(extra)
        return web.Response(
            body=msgspec.json.encode(body),
            content_type="application/json",
            headers={"x-fastroute-engine": self.name},
        )

    async def _stream(
        self,
        request: web.Request,
        parsed: Any,
        mreq: Request,
        chat: bool,
        response_id: str,
        output: OutputText,
    ) -> web.StreamResponse:
        channel: TokenChannel = mreq.data
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "x-fastroute-engine": self.name,
            }
        )
        await resp.prepare(request)
        enc = ChunkEncoder(chat, response_id, int(time.time()), self.spec.model_name)
        events = _StreamEvents(self, parsed, mreq, chat, enc)
        if chat and parsed.return_progress and self.spec.kind == "llamacpp":
            await resp.write(events.progress())
        target = mreq.output_tokens
        given = 0
        while given < target:
            if self._crash_due(given):
                raise _Abort
            await channel.wait()
            if channel.aborted:
                raise _Abort
            n = channel.take()
            parts = []
            for _ in range(n):
                if self._crash_due(given):
                    if parts:
                        await resp.write(b"".join(parts))
                    raise _Abort
                if self._stream_error_due(given):
                    parts.append(events.flush() + stream_error_event(_STREAM_ERROR_MESSAGE))
                    await resp.write(b"".join(parts))
                    await resp.write_eof()
                    return resp
                events.add(self._token_text(output, given, mreq), given, parts)
                given += 1
            if parts:
                await resp.write(b"".join(parts))
        opts = parsed.stream_options
        tail = b""
        if opts is not None and opts.include_usage:
            tail = enc.usage(self._usage(mreq, given))
        await resp.write(tail + SSE_DONE)
        await resp.write_eof()
        return resp


def _output_text(parsed: Any, chat: bool) -> OutputText:
    """The output of a request: seeded by its prompt, so the same request makes the same
    text on every engine, and a continuation (a chat's partial final assistant turn with
    ``continue_final_message``, a prompt that ends with an earlier output) goes on where
    the partial output stopped: token ``i`` of it is token ``i`` + (words of the partial
    output) of the uninterrupted output."""
    if not chat:
        prompt = parsed.prompt
        if isinstance(prompt, str):
            return continued_output(prompt, prompt_seed)
        return OutputText(prompt_seed(msgspec.json.encode(prompt).decode()))
    messages = parsed.messages
    if not parsed.continue_final_message:
        return OutputText(prompt_seed(render_chat(messages)))
    partial = messages[-1].get("content")
    done = len(partial.split()) if isinstance(partial, str) else 0
    return OutputText(prompt_seed(render_chat(messages[:-1])), done)


#: What a real vLLM says in-stream when its engine core dies.
_STREAM_ERROR_MESSAGE = (
    "EngineCore encountered an issue. See stack trace (above) for the root cause."
)


class _StreamEvents:
    """Groups one streamed response's tokens into SSE events as the engine would.

    The first token goes alone; then an event per ``stream_interval`` tokens (the request's, else
    the engine's); reasoning and content tokens never share an event; the last token's event
    carries the ``finish_reason``. The per-token fast path (:meth:`ChunkEncoder.token`) is kept
    for plain content without per-chunk usage.
    """

    __slots__ = ("engine", "mreq", "chat", "enc", "interval", "continuous", "thinking", "pending",
                 "pending_field")  # fmt: skip

    def __init__(
        self, engine: EmulatedEngine, parsed: Any, mreq: Request, chat: bool, enc: ChunkEncoder
    ) -> None:
        self.engine = engine
        self.mreq = mreq
        self.chat = chat
        self.enc = enc
        self.interval = parsed.stream_interval or engine.spec.stream_interval
        opts = parsed.stream_options
        self.continuous = bool(opts and opts.include_usage and opts.continuous_usage_stats)
        # a continued assistant turn is past its reasoning
        continuing = chat and parsed.continue_final_message
        self.thinking = engine.spec.reasoning_tokens if chat and not continuing else 0
        self.pending: list[str] = []
        self.pending_field = "content"

    def _usage(self, given: int) -> dict[str, Any] | None:
        return self.engine._usage(self.mreq, given) if self.continuous else None

    def progress(self) -> bytes:
        """llama.cpp's prompt-progress events: the cached part, then the whole prompt."""
        m = self.mreq
        return self.enc.progress(
            m.num_prompt_tokens, m.num_cached_tokens, m.num_cached_tokens, 0
        ) + (self.enc.progress(m.num_prompt_tokens, m.num_cached_tokens, m.num_prompt_tokens, 1))

    def add(self, text: str, index: int, parts: list[bytes]) -> None:
        """Token ``index`` (0-based) with ``text``: append the events it completes to ``parts``."""
        if index == 0 and self.chat:
            parts.append(self.enc.role(self._usage(0)))
        fld = REASONING_FIELD[self.engine.spec.kind] if index < self.thinking else "content"
        if self.pending and fld != self.pending_field:
            parts.append(self.flush(index))
        self.pending.append(text)
        self.pending_field = fld
        given = index + 1
        if given == self.mreq.output_tokens:
            parts.append(self._last(given))
        elif given == 1 or len(self.pending) >= self.interval:
            parts.append(self.flush(given))

    def flush(self, given: int | None = None) -> bytes:
        """The event of the tokens not yet written (``b""`` if none)."""
        if not self.pending:
            return b""
        text = "".join(self.pending)
        self.pending.clear()
        usage = None if given is None else self._usage(given)
        if self.pending_field == "content" and usage is None:
            return self.enc.token(text)
        return self.enc.event(text, field=self.pending_field, usage=usage)

    def _last(self, given: int) -> bytes:
        text = "".join(self.pending)
        self.pending.clear()
        extra = self.engine._final_extra(self.mreq)
        usage = self._usage(given)
        if self.pending_field == "content" and usage is None:
            return self.enc.last(text, self.mreq.finish_reason, extra)
        return self.enc.event(
            text,
            field=self.pending_field,
            finish_reason=self.mreq.finish_reason,
            usage=usage,
            extra=extra,
        )


def _dumps(obj: Any) -> str:
    return msgspec.json.encode(obj).decode()


class EmulatedFleet:
    """Several emulated engines in this process (an async context manager).

    Parameters
    ----------
    specs : iterable of EngineSpec
        One per engine; give port 0 for ephemeral ports.

    Examples
    --------
    >>> async def main():                                         # doctest: +SKIP
    ...     async with EmulatedFleet(fleet_specs(4, profile="h100")) as fleet:
    ...         print(fleet.urls)
    """

    def __init__(self, specs: list[EngineSpec] | tuple[EngineSpec, ...]) -> None:
        self.engines = [EmulatedEngine(spec) for spec in specs]

    @property
    def urls(self) -> list[str]:
        """Base URLs, in spec order."""
        return [e.url for e in self.engines]

    def __getitem__(self, index: int) -> EmulatedEngine:
        return self.engines[index]

    def __len__(self) -> int:
        return len(self.engines)

    async def start(self) -> None:
        """Start every engine (stopping those already started if one fails)."""
        started = []
        try:
            for engine in self.engines:
                await engine.start()
                started.append(engine)
        except BaseException:
            await asyncio.gather(*(e.stop() for e in started), return_exceptions=True)
            raise

    async def stop(self) -> None:
        """Stop every engine."""
        await asyncio.gather(*(e.stop() for e in self.engines))

    async def __aenter__(self) -> EmulatedFleet:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


def fleet_specs(
    count: int, *, base_port: int = 0, name_prefix: str = "engine", seed: int = 0, **kwargs: Any
) -> list[EngineSpec]:
    """``count`` specs named ``{name_prefix}-{i}``, ports ``base_port + i`` (all 0 if 0).

    Extra keyword arguments are :class:`EngineSpec` fields shared by all;
    engine ``i`` gets seed ``seed + i``.
    """
    return [
        EngineSpec(
            name=f"{name_prefix}-{i}",
            port=base_port + i if base_port else 0,
            seed=seed + i,
            **kwargs,
        )
        for i in range(count)
    ]
