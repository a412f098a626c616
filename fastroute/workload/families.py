"""Workload families that look like real traffic: one spec Struct per family (TOML-decodable).

A scenario's or benchmark spec's ``[family]`` table names its family with ``kind`` and
overrides any of that family's fields (all defaulted, units in the names):

* ``chat`` (:class:`Chat`) — multi-turn chat resending the whole history (a
  :class:`~fastroute.workload.ChatWorkload`);
* ``prefix-tree`` (:class:`PrefixTree`) — unrelated requests sharing leading 512-token
  blocks to varying depth: replayed from a Mooncake trace's ``hash_ids``, or drawn from a
  synthetic tree of blocks with a branching factor and a depth distribution;
* ``rag`` (:class:`Rag`) — shared long documents (Zipf popularity, heavy-tailed lengths)
  followed by short unique questions;
* ``agentic`` (:class:`Agentic`) — tool loops: each step resends the previous prompt
  plus the model's reply, a tool output and the new request; short outputs;
* ``long-tail`` (:class:`LongTail`) — heavy-tailed prompt lengths (lognormal or Pareto,
  mean ~11 k tokens after the clip) up to the context limit, no sharing;
* ``hot-prompt`` (:class:`HotPrompt`) — one long system prompt shared by every tenant,
  then unique user text.

Every family takes the common arrival fields of :class:`FamilyBase` (rate, burstiness,
bursts): the ``bursts`` family is any of them with ``burst_s > 0``. Sessions come from
:func:`fastroute.workload.family_gen.family_sessions`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from fastroute.workload.blocks import BLOCK_TOKENS
from fastroute.workload.spec import ChatWorkload, LogNormal, WorkloadError

__all__ = [
    "FamilyBase",
    "Chat",
    "PrefixTree",
    "Rag",
    "Agentic",
    "LongTail",
    "HotPrompt",
    "Family",
    "FAMILY_KINDS",
    "family_from_dict",
]

_OPTS: dict[str, Any] = {"frozen": True, "kw_only": True, "forbid_unknown_fields": True}

#: Context limit of the default families' model (Qwen2.5-3B: 32 768 tokens).
DEFAULT_MAX_CONTEXT_TOKENS = 32_768
#: Default output lengths of the single-turn families (ShareGPT-like, shorter tail).
_OUTPUT_TOKENS = LogNormal(median=150.0, sigma=0.8, min=1, max=1024)


def _bad(msg: str) -> None:
    # Raised from __post_init__; msgspec.convert attaches the path ($.family...).
    raise msgspec.ValidationError(msg)


def _check_lognormal(name: str, ln: LogNormal) -> None:
    if not (ln.median > 0 and ln.sigma >= 0 and 1 <= ln.min <= ln.max):
        _bad(f"{name} needs median > 0, sigma >= 0 and 1 <= min <= max")


class FamilyBase(msgspec.Struct, tag_field="kind", **_OPTS):  # type: ignore[call-arg]
    """Fields every family has: arrivals, bursts, model, outputs and the context limit.

    Arrivals are a renewal process of mean rate ``rate_rps`` requests/s (gamma gaps with
    coefficient of variation ``arrival_cv``; 1 = Poisson), then warped so that the
    intensity is ``burst_factor`` × the mean for ``burst_s`` of every ``burst_every_s``
    seconds and lower in between (the mean is kept; :func:`fastroute.workload.mix.burst_warp`).

    Attributes
    ----------
    rate_rps : float
        Mean offered requests per second, > 0 (a scenario's ``target_load`` or a
        benchmark's ``load`` overrides it). Multi-turn families convert it to sessions/s
        with their measured requests per session.
    arrival_cv : float
        Coefficient of variation of the gaps between arrivals (sessions), > 0.
    burst_every_s, burst_s : float
        Burst period and length, seconds; ``burst_s = 0``: no bursts.
    burst_factor : float
        Intensity during a burst relative to the mean, >= 1; needs
        ``burst_factor · burst_s < burst_every_s``.
    model : str
        Model of every request.
    output_tokens : LogNormal
        ``max_tokens`` of each request (the engines generate exactly this many).
    max_context_tokens : int
        A request's prompt plus ``max_tokens`` stays within this (the engines' context
        limit): longer prompts are trimmed, multi-turn sessions end before it.
    """

    rate_rps: float = 4.0
    arrival_cv: float = 1.0
    burst_every_s: float = 60.0
    burst_s: float = 0.0
    burst_factor: float = 1.0
    model: str = "qwen2.5-3b"
    output_tokens: LogNormal = _OUTPUT_TOKENS
    max_context_tokens: int = DEFAULT_MAX_CONTEXT_TOKENS

    def __post_init__(self) -> None:
        if not self.rate_rps > 0:
            _bad(f"rate_rps must be > 0, got {self.rate_rps}")
        if not self.arrival_cv > 0:
            _bad(f"arrival_cv must be > 0, got {self.arrival_cv}")
        if self.burst_s < 0:
            _bad(f"burst_s must be >= 0, got {self.burst_s}")
        if self.burst_s > 0:
            if not (self.burst_every_s > 0 and self.burst_factor >= 1):
                _bad("bursts need burst_every_s > 0 and burst_factor >= 1")
            if self.burst_factor * self.burst_s >= self.burst_every_s:
                _bad(
                    "bursts need burst_factor * burst_s < burst_every_s (got "
                    f"{self.burst_factor} * {self.burst_s} >= {self.burst_every_s})"
                )
        _check_lognormal("output_tokens", self.output_tokens)
        if self.max_context_tokens < self.output_tokens.min + 64:
            _bad(f"max_context_tokens={self.max_context_tokens} cannot hold a request")


class Chat(FamilyBase, tag="chat"):
    """Multi-turn chat with full histories.

    Attributes
    ----------
    workload : ChatWorkload
        Turns, lengths, tenants and think times; its session rate is set from
        ``rate_rps`` and its ``models`` from ``model``.
    """

    workload: ChatWorkload = ChatWorkload()


class PrefixTree(FamilyBase, tag="prefix-tree"):
    """Unrelated requests sharing leading blocks of varying depth.

    With ``trace`` set, rows of a Mooncake-format JSONL trace (``input_length``,
    ``output_length``, ``hash_ids``: equal ids = equal 512-token blocks) are replayed in
    order from a seeded start row, their inter-arrival pattern scaled to ``rate_rps``
    (wrapping round with fresh block ids when the window is longer than the trace).
    Without it, requests walk a synthetic tree: a root block among ``roots``, then at
    each level one of ``branching`` children, ``depth_blocks`` levels deep (roots and
    children Zipf-popular with exponent ``zipf_s``), then ``tail_tokens`` of unique text.
    Two requests whose walks agree on ``k`` levels share exactly ``k`` blocks. The
    defaults give about the reuse of the whole Mooncake release (≈ 50 % of blocks
    already seen as a prefix over 1000 requests; the trace itself: 53 % over its 3 321
    rows that fit 32 k, 11 % within its first 1000 rows) at a mean prompt of ~11 k tokens.

    Attributes
    ----------
    trace : str
        Mooncake JSONL trace, relative to the scenario/spec file; empty: synthetic.
    roots : int
        Distinct root blocks, >= 1.
    branching : int
        Children per block, >= 1.
    zipf_s : float
        Zipf exponent of root and child popularity, >= 0 (0 = uniform).
    depth_blocks : LogNormal
        Blocks of a request's walk (its shared part), >= 1.
    tail_tokens : LogNormal
        Unique tokens after the walk.
    block_tokens : int
        Tokens per block (Mooncake: 512).
    """

    trace: str = ""
    roots: int = 8
    branching: int = 2
    zipf_s: float = 2.0
    depth_blocks: LogNormal = LogNormal(median=16.0, sigma=0.7, min=1, max=60)
    tail_tokens: LogNormal = LogNormal(median=800.0, sigma=1.0, min=16, max=4096)
    block_tokens: int = BLOCK_TOKENS

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.roots < 1 or self.branching < 1 or self.block_tokens < 1:
            _bad("prefix-tree needs roots >= 1, branching >= 1 and block_tokens >= 1")
        if not self.zipf_s >= 0:
            _bad(f"zipf_s must be >= 0, got {self.zipf_s}")
        _check_lognormal("depth_blocks", self.depth_blocks)
        _check_lognormal("tail_tokens", self.tail_tokens)


class Rag(FamilyBase, tag="rag"):
    """Shared long documents followed by short unique questions.

    Attributes
    ----------
    documents : int
        Documents in the corpus, >= 1.
    zipf_s : float
        Zipf exponent of document popularity, >= 0.
    document_tokens : LogNormal
        Document lengths (drawn once per document: heavy-tailed).
    question_tokens : LogNormal
        Unique question after the document.
    """

    documents: int = 256
    zipf_s: float = 1.1
    document_tokens: LogNormal = LogNormal(median=3000.0, sigma=1.0, min=256, max=24_000)
    question_tokens: LogNormal = LogNormal(median=48.0, sigma=0.6, min=8, max=512)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.documents < 1:
            _bad(f"documents must be >= 1, got {self.documents}")
        if not self.zipf_s >= 0:
            _bad(f"zipf_s must be >= 0, got {self.zipf_s}")
        _check_lognormal("document_tokens", self.document_tokens)
        _check_lognormal("question_tokens", self.question_tokens)


class Agentic(FamilyBase, tag="agentic"):
    """Tool loops whose context grows by appends.

    A session is a task (``task_tokens`` after a system prompt of tool definitions
    shared by every session), then steps: each step's prompt is the previous prompt,
    the model's reply (a tool call), the tool's output and the next request. Steps are
    geometric with mean ``mean_steps`` (cut at ``max_steps`` or the context limit); the
    tool runs for an exponential ``tool_time_s`` between a reply and the next step.

    Attributes
    ----------
    system_prompt_tokens : int
        Tool definitions shared by all sessions, >= 0.
    task_tokens : LogNormal
        The task of step 0.
    tool_output_tokens : LogNormal
        Tool output plus new request appended at each later step.
    mean_steps : float
        Mean steps per session, >= 1.
    max_steps : int
        Hard bound on steps, >= 1.
    tool_time_s : float
        Mean tool latency between a reply and the next step, seconds, >= 0.
    """

    output_tokens: LogNormal = LogNormal(median=40.0, sigma=0.6, min=4, max=256)
    system_prompt_tokens: int = 2000
    task_tokens: LogNormal = LogNormal(median=200.0, sigma=0.8, min=16, max=2000)
    tool_output_tokens: LogNormal = LogNormal(median=500.0, sigma=1.0, min=8, max=8000)
    mean_steps: float = 8.0
    max_steps: int = 40
    tool_time_s: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (self.mean_steps >= 1 and self.max_steps >= 1 and self.tool_time_s >= 0):
            _bad("agentic needs mean_steps >= 1, max_steps >= 1 and tool_time_s >= 0")
        if self.system_prompt_tokens < 0:
            _bad("system_prompt_tokens must be >= 0")
        _check_lognormal("task_tokens", self.task_tokens)
        _check_lognormal("tool_output_tokens", self.tool_output_tokens)
        if self.system_prompt_tokens + self.task_tokens.min + 64 > self.max_context_tokens:
            _bad("max_context_tokens cannot hold the system prompt plus the smallest task")


class LongTail(FamilyBase, tag="long-tail"):
    """Heavy-tailed prompt lengths, unique text (little sharing).

    Prompt tokens are lognormal with the given mean and log-space ``sigma``, or Pareto
    with the given mean and tail index ``pareto_alpha``; clipped to
    ``[min_tokens, max_context_tokens − max_tokens]`` (the clip lowers the mean a little).

    Attributes
    ----------
    distribution : {"lognormal", "pareto"}
    mean_tokens : float
        Mean prompt tokens before clipping, > 0 (the default, 14 000, gives a mean of
        about 11 000 after the clip at a 32 k context).
    sigma : float
        Lognormal log-space standard deviation, > 0.
    pareto_alpha : float
        Pareto tail index, > 1 (a finite mean).
    min_tokens : int
        Shortest prompt, >= 1.
    system_prompt_tokens : int
        A short system prompt shared by all requests (the "little sharing"), >= 0.
    """

    distribution: Literal["lognormal", "pareto"] = "lognormal"
    mean_tokens: float = 14_000.0
    sigma: float = 1.0
    pareto_alpha: float = 1.6
    min_tokens: int = 64
    system_prompt_tokens: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (self.mean_tokens > 0 and self.sigma > 0 and self.pareto_alpha > 1):
            _bad("long-tail needs mean_tokens > 0, sigma > 0 and pareto_alpha > 1")
        if not 1 <= self.min_tokens < self.max_context_tokens:
            _bad(f"min_tokens must be in [1, max_context_tokens), got {self.min_tokens}")
        if self.system_prompt_tokens < 0:
            _bad("system_prompt_tokens must be >= 0")


class HotPrompt(FamilyBase, tag="hot-prompt"):
    """One long system prompt shared by all tenants, then unique user text.

    Attributes
    ----------
    system_prompt_tokens : int
        The shared system prompt, >= 1.
    tenants : int
        Tenants the requests are spread over (all with the same system prompt), >= 1.
    user_tokens : LogNormal
        Unique user text.
    """

    system_prompt_tokens: int = 6000
    tenants: int = 8
    user_tokens: LogNormal = LogNormal(median=150.0, sigma=1.0, min=4, max=4000)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.system_prompt_tokens < 1 or self.tenants < 1:
            _bad("hot-prompt needs system_prompt_tokens >= 1 and tenants >= 1")
        _check_lognormal("user_tokens", self.user_tokens)
        if self.system_prompt_tokens + self.user_tokens.min + 64 > self.max_context_tokens:
            _bad("max_context_tokens cannot hold the system prompt plus the smallest user text")


#: A family spec (decoded by its ``kind``).
Family = Chat | PrefixTree | Rag | Agentic | LongTail | HotPrompt
#: The ``kind`` of every family, in documentation order.
FAMILY_KINDS: tuple[str, ...] = (
    "chat",
    "prefix-tree",
    "rag",
    "agentic",
    "long-tail",
    "hot-prompt",
)


def family_from_dict(data: Mapping[str, Any]) -> Family:
    """Decode a ``[family]`` table (``kind`` selects the family).

    Raises
    ------
    WorkloadError
        No or an unknown ``kind``, wrong types, unknown keys or inconsistent values; the
        message names the field.
    """
    try:
        return msgspec.convert(dict(data), Family)  # type: ignore[arg-type]
    except msgspec.ValidationError as exc:
        raise WorkloadError(f"invalid family: {exc}") from None
