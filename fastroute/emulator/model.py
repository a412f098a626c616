"""The engine performance model: vLLM-style continuous batching, one scheduler step at a time.

Shared by the emulator server (driven by the wall clock) and the simulator
(driven by virtual time): the model performs no I/O and never reads a clock;
every method that depends on time takes ``now_s``. Given the same seed and the
same calls it produces the same schedule.

Scheduler (vLLM V1, FCFS, chunked prefill always on)
----------------------------------------------------
Each step has a token budget ``max_num_batched_tokens``.

1. **Running requests, in admission order.** A request that has emitted tokens
   needs one token (decode); one still processing its prompt (or recomputing
   after preemption) gets ``min(remaining, budget)`` tokens (a prefill chunk).
   New KV blocks are allocated as needed; if the cache has none, the *newest*
   running request is preempted (recompute): its blocks are released and it goes
   back to the *front* of the waiting queue — possibly the request itself.
2. **Waiting requests**, only if nothing was preempted this step, while
   ``running < max_num_seqs`` and budget remains: look up the longest cached
   prefix (full blocks, at most ``prompt − 1`` tokens so one token is always
   computed), allocate blocks for the first chunk, admit. The head of the queue
   blocks the rest (FCFS).

A request's "new tokens" are ``prompt + emitted − computed``; the step that
brings ``computed`` up to ``prompt + emitted`` emits one token. Decodes are
therefore one-token steps, and a preempted request resumes by recomputing its
prompt and generated tokens, exactly as vLLM's recompute preemption does.

Step time
---------
From the :class:`~fastroute.hardware.HardwareProfile` coefficients,
with B decoding sequences of total context S and prefill chunks (n new tokens
over c already computed)::

    T = slowdown · [ (b0 if B else a0) + b1·B + b2·S + Σ_chunks (a1·n + a2·n² + a3·n·c) ]

Tokens emitted by a step are delivered at its end. Work per step is O(requests
scheduled + blocks touched); there are no per-token events.

Disaggregated prefill/decode
----------------------------
A request submitted with ``hold_kv=True`` (prefill side) keeps its blocks after
finishing, until :meth:`EngineModel.claim_transfer` releases them or
``kv_transfer_timeout_s`` expires. A request with ``remote_prefill=True``
(decode side) is admitted by allocating blocks for ``prompt − 1`` tokens (minus
local prefix-cache hits) and waiting ``kv_transfer_latency_s + bytes /
kv_transfer_bandwidth_Bps`` for them (state ``LOADING``, counted as waiting);
it then computes the last prompt token and decodes.
"""

from __future__ import annotations

import enum
import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastroute.emulator.kvcache import KVCache
from fastroute.hardware import BLOCK_SIZE_TOKENS, HardwareProfile

__all__ = [
    "EngineConfig",
    "EngineModel",
    "Request",
    "Phase",
    "StepResult",
    "OutputLengthDistribution",
    "QueueFullError",
    "RequestTooLongError",
    "replay",
]

_BS = BLOCK_SIZE_TOKENS


class QueueFullError(Exception):
    """The waiting queue is at ``max_waiting``: the request was not accepted."""


class RequestTooLongError(ValueError):
    """The request can never fit: over ``max_model_len`` or over the whole KV cache."""


class Phase(enum.Enum):
    """Where a request is in the engine."""

    WAITING = "waiting"
    LOADING = "loading"  # decode side: KV arriving from a prefill engine
    RUNNING = "running"
    HELD = "held"  # prefill side: finished, blocks kept for the decode engine
    FINISHED = "finished"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Scheduler and cache settings of one engine (vLLM's names where they exist).

    Attributes
    ----------
    max_num_seqs : int
        Most requests running at once.
    max_num_batched_tokens : int or None
        Token budget per step; the profile's vLLM default if None.
    max_model_len : int or None
        Longest prompt + output; the profile model's if None.
    num_blocks : int or None
        Override the profile's KV capacity (in blocks of 16 tokens), e.g. to
        force preemption in tests.
    max_waiting : int
        Longest waiting queue; :meth:`EngineModel.submit` raises
        :class:`QueueFullError` beyond it.
    enable_prefix_caching : bool
        Reuse cached prompt blocks (vLLM V1 default: on).
    kv_transfer_bandwidth_Bps : float
        P→D KV transfer bandwidth (default 12.5 GB/s: one 100 Gb/s NIC).
    kv_transfer_latency_s : float
        Fixed P→D transfer latency (handshake + first byte).
    kv_transfer_timeout_s : float
        How long a prefill engine keeps KV for a decode engine that never
        claims it (vLLM's ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    num_blocks: int | None = None
    max_waiting: int = 1024
    enable_prefix_caching: bool = True
    kv_transfer_bandwidth_Bps: float = 12.5e9
    kv_transfer_latency_s: float = 1.0e-3
    kv_transfer_timeout_s: float = 480.0


@dataclass(frozen=True, slots=True)
class OutputLengthDistribution:
    """Output lengths when the request does not fix them: lognormal, capped.

    ``N = max(1, round(exp(mu + sigma·Z)))``, Z standard normal. The defaults
    (median e^5.3 ≈ 200 tokens) follow docs/algorithms.md §7.2's
    ShareGPT-like workload.
    """

    mu: float = 5.3
    sigma: float = 0.9

    def sample(self, rng: random.Random) -> int:
        """Draw one length (≥ 1) from ``rng``."""
        return max(1, round(rng.lognormvariate(self.mu, self.sigma)))


class Request:
    """One sequence inside an :class:`EngineModel`.

    Parameters
    ----------
    request_id : str
        Unique among the engine's live requests.
    num_prompt_tokens : int
        Prompt length in tokens (≥ 1).
    block_hashes : sequence of int
        Chained hashes of the prompt's full blocks (prefix-cache identity).
    output_tokens : int
        How many tokens the request will emit before finishing (≥ 1).
    finish_reason : str
        Reported when it finishes: ``"stop"`` (EOS) or ``"length"`` (cap).
    remote_prefill : bool
        Decode side of P/D: the prompt's KV is transferred, not computed.
    hold_kv : bool
        Prefill side of P/D: keep the blocks after finishing for a decode engine.
    data : object
        Opaque to the model (the server's per-request channel).

    Notes
    -----
    Timing attributes (``arrival_s``, ``first_token_s``, ``last_token_s``,
    ``finish_s``, ``last_itl_s``) are set by the model, in the caller's clock.
    """

    __slots__ = (
        "request_id",
        "num_prompt_tokens",
        "block_hashes",
        "output_tokens",
        "finish_reason",
        "remote_prefill",
        "hold_kv",
        "data",
        "phase",
        "num_computed",
        "num_output",
        "cached_hashes",
        "num_private",
        "next_block_to_name",
        "num_cached_tokens",
        "num_transferred_tokens",
        "num_preemptions",
        "ready_s",
        "arrival_s",
        "scheduled_s",
        "first_token_s",
        "last_token_s",
        "last_itl_s",
        "finish_s",
        "expiry_s",
    )

    def __init__(
        self,
        request_id: str,
        num_prompt_tokens: int,
        block_hashes: Sequence[int] = (),
        *,
        output_tokens: int,
        finish_reason: str = "length",
        remote_prefill: bool = False,
        hold_kv: bool = False,
        data: Any = None,
    ) -> None:
        if num_prompt_tokens < 1:
            raise ValueError("a request needs at least one prompt token")
        if output_tokens < 1:
            raise ValueError("a request emits at least one token")
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.block_hashes = tuple(block_hashes)
        self.output_tokens = output_tokens
        self.finish_reason = finish_reason
        self.remote_prefill = remote_prefill
        self.hold_kv = hold_kv
        self.data = data
        self.phase = Phase.WAITING
        self.num_computed = 0
        self.num_output = 0
        self.cached_hashes: list[int] = []
        self.num_private = 0
        self.next_block_to_name = 0
        self.num_cached_tokens = 0
        self.num_transferred_tokens = 0
        self.num_preemptions = 0
        self.ready_s = 0.0
        self.arrival_s = 0.0
        self.scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.last_itl_s: float | None = None
        self.finish_s: float | None = None
        self.expiry_s = 0.0

    @property
    def num_blocks_held(self) -> int:
        """KV blocks this request references."""
        return len(self.cached_hashes) + self.num_private

    @property
    def finished(self) -> bool:
        """True once it emitted its last token (held or finished)."""
        return self.phase is Phase.FINISHED or self.phase is Phase.HELD

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output}/{self.output_tokens}, {self.phase.value})"
        )


@dataclass(slots=True)
class StepResult:
    """What one scheduler step did.

    Attributes
    ----------
    start_s, end_s, duration_s : float
        When the step ran; its tokens are delivered at ``end_s``.
    emitted : list of Request
        Requests that emitted one token this step (first tokens included).
    finished : list of Request
        Requests whose last token was emitted this step (a subset of ``emitted``).
    preempted : list of Request
        Requests preempted (sent back to the waiting queue) this step.
    num_decode_seqs : int
        B: sequences decoding one token.
    num_decode_context_tokens : int
        S: their total context.
    num_prefill_tokens : int
        New prompt (or recompute) tokens processed in prefill chunks.
    """

    start_s: float
    end_s: float
    duration_s: float
    emitted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_decode_seqs: int = 0
    num_decode_context_tokens: int = 0
    num_prefill_tokens: int = 0

    @property
    def idle(self) -> bool:
        """True if the step computed nothing."""
        return self.num_decode_seqs == 0 and self.num_prefill_tokens == 0


def _blocks_for(tokens: int) -> int:
    return -(-tokens // _BS)


class EngineModel:
    """Performance model of one vLLM engine.

    Parameters
    ----------
    profile : HardwareProfile
        Step-time coefficients and KV capacity.
    config : EngineConfig, optional
        Scheduler settings; defaults otherwise.
    seed : int
        Seeds :attr:`rng` (output lengths drawn by callers via
        :meth:`sample_output_tokens`).

    Attributes
    ----------
    slowdown : float
        Multiplier on every step time (fault injection: 2.0 = half speed).
    rng : random.Random
        The model's seeded random source.
    num_preemptions_total, prompt_tokens_total, generation_tokens_total : int
        Cumulative counters (vLLM's ``num_preemptions``, ``prompt_tokens``,
        ``generation_tokens``); prompt tokens are counted, whole, when a
        request emits its first token.
    prefix_cache_queries_total, prefix_cache_hits_total : int
        Prompt tokens looked up in, and found in, the prefix cache.
    finished_total : dict of str to int
        Finished requests by finish reason (``stop``, ``length``, ``abort``).
    """

    def __init__(
        self, profile: HardwareProfile, config: EngineConfig | None = None, seed: int = 0
    ) -> None:
        self.profile = profile
        self.config = config = config or EngineConfig()
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = (
            config.max_num_batched_tokens or profile.default_max_num_batched_tokens
        )
        self.max_model_len = config.max_model_len or profile.model.max_model_len
        self.kv = KVCache(config.num_blocks or profile.num_blocks)
        self.rng = random.Random(seed)
        self.slowdown = 1.0
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._loading: list[Request] = []
        self._held: dict[str, Request] = {}
        self._held_expiry: list[tuple[float, str]] = []
        self._live: dict[str, Request] = {}
        self._busy_until_s = -math.inf
        self.num_preemptions_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.prefix_cache_queries_total = 0
        self.prefix_cache_hits_total = 0
        self.num_steps_total = 0
        self.finished_total: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}

    # -- introspection -------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        """Requests in the running batch."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests waiting, including those whose KV is still arriving (as vLLM counts them)."""
        return len(self._waiting) + len(self._loading)

    @property
    def num_held(self) -> int:
        """Finished prefill-side requests whose KV awaits a decode engine."""
        return len(self._held)

    @property
    def kv_usage(self) -> float:
        """KV-cache usage 0–1 (referenced blocks / all blocks)."""
        return self.kv.usage

    @property
    def busy_until_s(self) -> float:
        """End of the step in progress (−inf before the first step)."""
        return self._busy_until_s

    def get(self, request_id: str) -> Request | None:
        """Return the live (waiting, loading or running) request ``request_id``, if any."""
        return self._live.get(request_id)

    def sample_output_tokens(
        self, cap: int, dist: OutputLengthDistribution = OutputLengthDistribution()
    ) -> int:
        """Draw an output length from ``dist`` with :attr:`rng`, capped at ``cap``."""
        return min(cap, dist.sample(self.rng))

    def transfer_time_s(self, num_tokens: int) -> float:
        """Time to receive the KV of ``num_tokens`` tokens from a prefill engine."""
        cfg = self.config
        nbytes = num_tokens * self.profile.kv_bytes_per_token
        return cfg.kv_transfer_latency_s + nbytes / cfg.kv_transfer_bandwidth_Bps

    # -- requests ------------------------------------------------------------------------------
    def check(self, num_prompt_tokens: int, output_tokens: int) -> None:
        """Raise :class:`RequestTooLongError` if such a request could never be served."""
        total = num_prompt_tokens + output_tokens
        if total > self.max_model_len:
            raise RequestTooLongError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {total} tokens ({num_prompt_tokens} in the messages, "
                f"{output_tokens} in the completion). Please reduce the length of the "
                "messages or completion."
            )
        if _blocks_for(total) > self.kv.num_blocks:
            raise RequestTooLongError(
                f"request needs {_blocks_for(total)} KV blocks; the cache has {self.kv.num_blocks}"
            )

    def submit(self, request: Request, now_s: float) -> None:
        """Queue ``request``, arrived at ``now_s``.

        Raises
        ------
        QueueFullError
            If ``max_waiting`` requests are already waiting.
        RequestTooLongError
            If it can never fit (see :meth:`check`).
        ValueError
            If its id is already live.
        """
        if len(self._waiting) >= self.config.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} requests)")
        self.check(request.num_prompt_tokens, request.output_tokens)
        if request.request_id in self._live:
            raise ValueError(f"request {request.request_id!r} is already in the engine")
        request.arrival_s = now_s
        request.phase = Phase.WAITING
        self._waiting.append(request)
        self._live[request.request_id] = request

    def cancel(self, request_id: str) -> bool:
        """Abort a waiting, loading, running or held request; True if it was there.

        Its blocks are released at once; a step in progress that scheduled it
        still reports it, and the caller ignores those tokens.
        """
        req = self._live.pop(request_id, None)
        if req is None:
            held = self._held.pop(request_id, None)
            if held is None:
                return False
            self._release_blocks(held)
            held.phase = Phase.FINISHED
            return True
        if req.phase is Phase.WAITING:
            self._waiting.remove(req)
        elif req.phase is Phase.RUNNING:
            self._running.remove(req)
        elif req.phase is Phase.LOADING:
            self._loading.remove(req)
        self._release_blocks(req)
        req.phase = Phase.CANCELLED
        self.finished_total["abort"] += 1
        return True

    def held(self, request_id: str, now_s: float) -> Request | None:
        """Return the request whose KV is held for a decode engine, if not claimed or expired."""
        self._expire_held(now_s)
        return self._held.get(request_id)

    def claim_transfer(self, request_id: str, now_s: float) -> Request:
        """Hand a held request's KV to a decode engine: release its blocks, return it.

        Raises
        ------
        KeyError
            If no KV is held for ``request_id`` (never existed, already claimed or expired).
        """
        self._expire_held(now_s)
        req = self._held.pop(request_id)
        self._release_blocks(req)
        req.phase = Phase.FINISHED
        if len(self._held_expiry) > 2 * len(self._held) + 64:
            # Claimed entries linger in the heap until their expiry; keep it O(held).
            self._held_expiry = [(r.expiry_s, rid) for rid, r in self._held.items()]
            heapq.heapify(self._held_expiry)
        return req

    # -- stepping ------------------------------------------------------------------------------
    def next_step_time(self, now_s: float) -> float | None:
        """When the next step should start, or None if the engine has nothing to do.

        Returns ``max(now_s, end of the current step)`` when there is work; the
        earliest KV arrival (or held-KV expiry that could unblock the queue)
        when the engine only waits for those; None when idle.
        """
        start = max(now_s, self._busy_until_s)
        if self._running:
            return start
        if self._loading:
            ready = min(r.ready_s for r in self._loading)
            if ready <= start:
                return start
        else:
            ready = math.inf
        if self._waiting and self._head_admissible(start):
            return start
        if self._waiting and self._held_expiry:
            ready = min(ready, max(start, self._held_expiry[0][0]))
        return None if ready == math.inf else max(ready, start)

    def _head_admissible(self, now_s: float) -> bool:
        if len(self._running) + len(self._loading) >= self.max_num_seqs:
            return False
        self._expire_held(now_s)
        req = self._waiting[0]
        hits, evictable = self._lookup(req)
        first = (
            (req.num_prompt_tokens - 1)
            if req.remote_prefill
            else (
                min(
                    req.num_prompt_tokens + req.num_output, hits * _BS + self.max_num_batched_tokens
                )
            )
        )
        return _blocks_for(first) - hits <= self.kv.num_available - evictable

    def _lookup(self, req: Request) -> tuple[int, int]:
        if not self.config.enable_prefix_caching or not req.block_hashes:
            return 0, 0
        # One prompt token is always computed, so a fully cached prompt hits one block less.
        return self.kv.lookup(req.block_hashes, (req.num_prompt_tokens - 1) // _BS)

    def step(self, now_s: float) -> StepResult:
        """Run one scheduler step starting at ``now_s``.

        The state moves to the end of the step at once; the returned result
        says which tokens the step emits and when it ends (``end_s``). The next
        step cannot start before ``end_s``.

        Raises
        ------
        ValueError
            If ``now_s`` is before the end of the previous step.
        """
        if now_s < self._busy_until_s - 1e-12:
            raise ValueError(
                f"step at {now_s} before the previous step ends ({self._busy_until_s})"
            )
        self._expire_held(now_s)
        if self._loading:
            self._finish_loading(now_s)
        kv = self.kv
        running = self._running
        budget = self.max_num_batched_tokens
        name_blocks = self.config.enable_prefix_caching
        emitted: list[Request] = []
        preempted: list[Request] = []
        n_dec = s_dec = n_pf = n_pf2 = n_pfc = 0

        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            total = req.num_prompt_tokens + req.num_output
            c = req.num_computed
            n = total - c
            if n > budget:
                n = budget
            need = _blocks_for(c + n) - req.num_blocks_held
            if need > 0:
                while not kv.allocate(need):
                    victim = running.pop()
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is req:
                        break
                if req.phase is not Phase.RUNNING:
                    continue  # it preempted itself; nothing left behind it either
                req.num_private += need
            if n == 1 and req.num_output and c + 1 == total:
                n_dec += 1
                s_dec += total
            else:
                n_pf += n
                n_pf2 += n * n
                n_pfc += n * c
            req.num_computed = c = c + n
            budget -= n
            if name_blocks and req.next_block_to_name < len(req.block_hashes):
                self._name_blocks(req)
            if c == total:
                emitted.append(req)
            i += 1

        if not preempted and self._waiting:
            a_pf, a_pf2, a_pfc = self._admit(now_s, budget, emitted)
            n_pf += a_pf
            n_pf2 += a_pf2
            n_pfc += a_pfc

        p = self.profile
        if n_dec or n_pf:
            base = p.b0_s if n_dec else p.a0_s
            duration = self.slowdown * (
                base
                + p.b1_s * n_dec
                + p.b2_s * s_dec
                + p.a1_s * n_pf
                + p.a2_s * n_pf2
                + p.a3_s * n_pfc
            )
        else:
            duration = 0.0
        end = now_s + duration
        self._busy_until_s = end
        self.num_steps_total += 1
        result = StepResult(now_s, end, duration, emitted, [], preempted, n_dec, s_dec, n_pf)
        self._emit(result)
        return result

    def fast_forward(
        self, now_s: float, until_s: float = math.inf, *, dry_run: bool = False
    ) -> tuple[int, float, float]:
        """Run, in closed form, the decode-only steps that nobody can observe.

        When only decodes run (nothing waiting or loading), the next
        ``min(remaining outputs) − 1`` steps emit no first and no last token: each
        adds one token to every running request and its duration follows
        ``b0 + b1·B + b2·(S0 + j·B)``. This applies the steps that *start* before
        ``until_s`` at once — the same state, counters and float step times as that
        many :meth:`step` calls — provided the KV blocks they need can be allocated
        (otherwise a step would preempt, and the caller must :meth:`step`).

        Parameters
        ----------
        now_s : float
            Start of the first step (``>=`` the end of the previous one).
        until_s : float
            Only steps starting strictly before this are applied (the caller's next event).
        dry_run : bool
            Only compute what would be applied; change nothing. Until the model is
            next touched, applying with ``until_s`` = the returned ``end_s`` then
            applies exactly those steps.

        Returns
        -------
        (steps, end_s, busy_s) : (int, float, float)
            Steps applied (0 if none could be), when the last one ends (the next
            step's earliest start; ``now_s`` if none), and their total duration.
        """
        running = self._running
        # Held KV (P/D) may expire mid-run and change what allocation evicts: step() then.
        if self._waiting or self._loading or self._held or not running or now_s >= until_s:
            return 0, now_s, 0.0
        if now_s < self._busy_until_s - 1e-12:
            raise ValueError(
                f"step at {now_s} before the previous step ends ({self._busy_until_s})"
            )
        n_dec = len(running)
        if n_dec > self.max_num_batched_tokens:
            return 0, now_s, 0.0
        k = 1 << 62
        s_dec = 0
        for req in running:
            total = req.num_prompt_tokens + req.num_output
            if not req.num_output or req.num_computed + 1 != total:
                return 0, now_s, 0.0  # a prefill chunk or recompute is in the batch
            left = req.output_tokens - req.num_output
            if left < k:
                k = left
            s_dec += total
        k -= 1  # the step emitting somebody's last token is left to step()
        if k <= 0:
            return 0, now_s, 0.0
        p = self.profile
        slowdown = self.slowdown
        t = t_prev = now_s
        steps = 0
        # step()'s float expression, (b0 + b1·B) + b2·S (its prefill terms add exact
        # zeros), so the times match a step-by-step run bit for bit.
        c0 = p.b0_s + p.b1_s * n_dec
        b2 = p.b2_s
        while steps < k and t < until_s:
            t_prev = t
            t = t + slowdown * (c0 + b2 * s_dec)
            s_dec += n_dec
            steps += 1
        need = 0
        for req in running:
            need += -(-(req.num_computed + steps) // _BS) - len(req.cached_hashes) - req.num_private
        if dry_run:
            return (steps, t, t - now_s) if need <= self.kv.num_available else (0, now_s, 0.0)
        if need > 0 and not self.kv.allocate(need):
            return 0, now_s, 0.0
        for req in running:
            req.num_private = -(-(req.num_computed + steps) // _BS) - len(req.cached_hashes)
            req.num_computed += steps
            req.num_output += steps
            req.last_itl_s = t - (t_prev if steps > 1 else req.last_token_s)
            req.last_token_s = t
        self.generation_tokens_total += steps * n_dec
        self.num_steps_total += steps
        self._busy_until_s = t
        return steps, t, t - now_s

    # -- internals -----------------------------------------------------------------------------
    def _admit(self, now_s: float, budget: int, emitted: list[Request]) -> tuple[int, int, int]:
        """Admit waiting requests into the batch; return their prefill work (Σn, Σn², Σn·c)."""
        kv = self.kv
        waiting = self._waiting
        running = self._running
        n_pf = n_pf2 = n_pfc = 0
        while waiting and budget > 0 and len(running) + len(self._loading) < self.max_num_seqs:
            req = waiting[0]
            hits, evictable = self._lookup(req)
            cached_tokens = hits * _BS
            if req.remote_prefill:
                computed_after = req.num_prompt_tokens - 1
                n = 0
            else:
                total = req.num_prompt_tokens + req.num_output
                n = min(total - cached_tokens, budget)
                computed_after = cached_tokens + n
            need = _blocks_for(computed_after) - hits
            if need > kv.num_available - evictable:
                break  # FCFS: the head blocks the queue until blocks free up
            waiting.popleft()
            if hits:
                hashes = req.block_hashes[:hits]
                kv.acquire(hashes)
                req.cached_hashes.extend(hashes)
            kv.allocate(need)
            req.num_private = need
            req.next_block_to_name = hits
            if self.config.enable_prefix_caching:
                self.prefix_cache_queries_total += req.num_prompt_tokens
                self.prefix_cache_hits_total += cached_tokens
            if req.scheduled_s is None:
                req.scheduled_s = now_s
                req.num_cached_tokens = cached_tokens
            if req.remote_prefill:
                # The KV of the prompt but its last token comes from the prefill engine.
                moved = computed_after - cached_tokens
                req.num_transferred_tokens = moved
                req.num_cached_tokens = cached_tokens + moved
                req.num_computed = computed_after
                req.remote_prefill = False
                req.ready_s = now_s + self.slowdown * self.transfer_time_s(moved)
                req.phase = Phase.LOADING
                self._loading.append(req)
                continue
            req.num_computed = computed_after
            req.phase = Phase.RUNNING
            running.append(req)
            n_pf += n
            n_pf2 += n * n
            n_pfc += n * cached_tokens
            budget -= n
            if self.config.enable_prefix_caching and req.next_block_to_name < len(req.block_hashes):
                self._name_blocks(req)
            if computed_after == req.num_prompt_tokens + req.num_output:
                emitted.append(req)
        return n_pf, n_pf2, n_pfc

    def _name_blocks(self, req: Request) -> None:
        """Publish the request's newly completed full prompt blocks to the prefix cache."""
        full = min(req.num_computed, req.num_prompt_tokens) // _BS
        idx = req.next_block_to_name
        if full <= idx:
            return
        kv = self.kv
        hashes = req.block_hashes
        for j in range(idx, min(full, len(hashes))):
            kv.name_block(hashes[j])
            req.cached_hashes.append(hashes[j])
        req.num_private -= min(full, len(hashes)) - idx
        req.next_block_to_name = full

    def _emit(self, result: StepResult) -> None:
        """Apply the tokens of a step: timings, counters, finishes."""
        end = result.end_s
        finished = result.finished
        for req in result.emitted:
            req.num_output += 1
            self.generation_tokens_total += 1
            if req.first_token_s is None:
                req.first_token_s = end
                req.last_itl_s = None
                self.prompt_tokens_total += req.num_prompt_tokens
            else:
                req.last_itl_s = end - req.last_token_s  # type: ignore[operator]
            req.last_token_s = end
            if req.num_output >= req.output_tokens:
                finished.append(req)
        for req in finished:
            self._running.remove(req)
            del self._live[req.request_id]
            req.finish_s = end
            self.finished_total[req.finish_reason] = (
                self.finished_total.get(req.finish_reason, 0) + 1
            )
            if req.hold_kv:
                req.phase = Phase.HELD
                req.expiry_s = end + self.config.kv_transfer_timeout_s
                self._held[req.request_id] = req
                heapq.heappush(self._held_expiry, (req.expiry_s, req.request_id))
            else:
                self._release_blocks(req)
                req.phase = Phase.FINISHED

    def _preempt(self, req: Request) -> None:
        self._release_blocks(req)
        req.num_computed = 0
        req.next_block_to_name = 0
        req.num_preemptions += 1
        req.phase = Phase.WAITING
        self._waiting.appendleft(req)
        self.num_preemptions_total += 1

    def _release_blocks(self, req: Request) -> None:
        if req.cached_hashes:
            self.kv.release(req.cached_hashes)
            req.cached_hashes = []
        if req.num_private:
            self.kv.free(req.num_private)
            req.num_private = 0

    def _finish_loading(self, now_s: float) -> None:
        still = []
        for req in self._loading:
            if req.ready_s <= now_s and len(self._running) < self.max_num_seqs:
                req.phase = Phase.RUNNING
                self._running.append(req)
            else:
                still.append(req)
        self._loading = still

    def _expire_held(self, now_s: float) -> None:
        heap = self._held_expiry
        while heap and heap[0][0] <= now_s:
            _, request_id = heapq.heappop(heap)
            req = self._held.get(request_id)
            if req is not None and req.expiry_s <= now_s:
                del self._held[request_id]
                self._release_blocks(req)
                req.phase = Phase.FINISHED


def replay(
    model: EngineModel,
    arrivals: Iterable[tuple[float, Request]],
    *,
    max_steps: int = 10_000_000,
    on_finished: Callable[[Request], Iterable[tuple[float, Request]]] | None = None,
    on_refused: Callable[[Request], None] | None = None,
) -> list[Request]:
    """Run ``model`` in virtual time over ``arrivals`` until every request finishes.

    The one replay loop of an engine model: the simulator's saturation capacity feeds
    it a batch, the fleet benchmark's SLO capacity closed-loop sessions (a turn's
    finish schedules the next turn through ``on_finished``).

    Parameters
    ----------
    model : EngineModel
        A fresh model (or one whose clock is behind the first arrival).
    arrivals : iterable of (arrival_s, Request)
        Requests and when they arrive; ties arrive in the given order.
    max_steps : int
        Safety bound on the number of loop iterations (arrival batches and steps).
    on_finished : callable, optional
        Called with each request as it finishes (in step order); returns the further
        arrivals it causes (a session's next turn), which must not lie in the past.
    on_refused : callable, optional
        Called with a request the model refuses (:class:`QueueFullError`); without it
        the error propagates.

    Returns
    -------
    list of Request
        The requests in arrival order (refused ones included), with their timings
        filled in.
    """
    pending: list[tuple[float, int, Request]] = []
    for at, req in arrivals:
        heapq.heappush(pending, (at, len(pending), req))
    pushed = len(pending)
    arrived: list[Request] = []
    t = pending[0][0] if pending else 0.0
    for _ in range(max_steps):
        nxt = model.next_step_time(t)
        if pending and (nxt is None or pending[0][0] <= nxt):
            t = max(t, pending[0][0])
            while pending and pending[0][0] <= t:
                _, _, req = heapq.heappop(pending)
                arrived.append(req)
                try:
                    model.submit(req, t)
                except QueueFullError:
                    if on_refused is None:
                        raise
                    on_refused(req)
            continue
        if nxt is None:
            break
        t = nxt
        finished = model.step(t).finished
        if on_finished is not None:
            for req in finished:
                for at, follow_up in on_finished(req):
                    heapq.heappush(pending, (at, pushed, follow_up))
                    pushed += 1
    else:
        raise RuntimeError(f"replay did not finish within {max_steps} steps")
    return arrived
