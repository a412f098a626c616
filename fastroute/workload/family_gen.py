"""Sessions of the workload families (:mod:`fastroute.workload.families`), seeded.

:func:`family_sessions` draws arrivals (a gamma renewal process at ``rate_rps``, then the
burst warp), then one generator per family builds each request's text so that sharing is
byte-exact: shared parts (tree blocks, documents, system prompts) are rendered from
their ids alone (:class:`~fastroute.workload.blocks.BlockTexts`), unshared parts start
with the request's own id. Every random draw comes from :class:`random.Random` streams
seeded from (family kind, seed), so the output depends only on (family, duration, seed,
sources).
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import random
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from fastroute.tokens import BYTES_PER_TOKEN
from fastroute.workload.blocks import BlockTexts
from fastroute.workload.families import (
    Agentic,
    Chat,
    Family,
    FamilyBase,
    HotPrompt,
    LongTail,
    PrefixTree,
    Rag,
)
from fastroute.workload.generate import generate_sessions
from fastroute.workload.mix import burst_warp
from fastroute.workload.session import (
    CHAT_OVERHEAD_TOKENS,
    Session,
    Turn,
    make_text,
    system_prompt_text,
)
from fastroute.workload.spec import Weighted, WorkloadError

__all__ = ["family_sessions", "arrival_times", "requests_per_session"]

#: Tokens kept free under the context limit for the chat template around a system prompt
#: and rounding (the prompt is rendered with headers the emulator counts too).
_TEMPLATE_MARGIN_TOKENS = 32
#: Bytes of one output token re-rendered as reply text (see generate._REPLY_BYTES_PER_TOKEN).
_REPLY_BYTES_PER_TOKEN = 6
#: Sessions generated to measure a multi-turn family's requests per session.
_PROBE_SESSIONS = 400
#: Block-id offset of each wrap round a trace replay makes (fresh blocks per round).
_TRACE_WRAP_ID_OFFSET = 1 << 40

Maker = Callable[[int, str, random.Random], Session]


def arrival_times(family: FamilyBase, rate_per_s: float, duration_s: float, rng: random.Random):
    """Arrival times in ``[0, duration_s)`` at mean ``rate_per_s``, with the family's bursts.

    Gamma gaps with CV ``arrival_cv`` in mean-rate time, mapped through
    :func:`~fastroute.workload.mix.burst_warp` (burst phase drawn from ``rng``) and
    shifted so that mean-rate time 0 is real time 0.
    """
    cv2 = family.arrival_cv**2
    shape, scale = 1.0 / cv2, cv2 / rate_per_s
    bursty = family.burst_s > 0 and family.burst_factor > 1
    phase = rng.uniform(0.0, family.burst_every_s) if bursty else 0.0

    def warp(u: float) -> float:
        if not bursty:
            return u
        args = (family.burst_every_s, family.burst_s, family.burst_factor, phase)
        return burst_warp(u, *args) - burst_warp(0.0, *args)

    out: list[float] = []
    u = rng.gammavariate(shape, scale)
    while (t := warp(u)) < duration_s:
        out.append(t)
        u += rng.gammavariate(shape, scale)
    return out


def _zipf_cum(n: int, s: float) -> list[float]:
    return list(itertools.accumulate((k + 1) ** -s for k in range(n)))


def _zipf(rng: random.Random, cum: list[float]) -> int:
    return min(len(cum) - 1, bisect.bisect_right(cum, rng.random() * cum[-1]))


def _single(sid: str, source: str, model: str, system: str, text: str, out: int) -> Session:
    return Session(
        session_id=sid,
        tenant="default",
        source=source,
        model=model,
        start_s=0.0,
        system_prompt=system,
        turns=(Turn(user_text=text, user_tokens=len(text) // BYTES_PER_TOKEN, max_tokens=out),),
    )


def _room(f: FamilyBase, out: int, system_tokens: int = 0) -> int:
    """User tokens that fit next to ``out`` output tokens and the system prompt."""
    return max(
        1,
        f.max_context_tokens - out - system_tokens - CHAT_OVERHEAD_TOKENS - _TEMPLATE_MARGIN_TOKENS,
    )


def _tree_maker(f: PrefixTree, seed: int) -> Maker:
    blocks = BlockTexts("tree", f.block_tokens)
    root_cum = _zipf_cum(f.roots, f.zipf_s)
    child_cum = _zipf_cum(f.branching, f.zipf_s)

    def make(i: int, source: str, rng: random.Random) -> Session:
        sid = f"tree-{seed}-{i:06d}"
        out = f.output_tokens.sample(rng.gauss(0.0, 1.0))
        depth = f.depth_blocks.sample(rng.gauss(0.0, 1.0))
        tail = f.tail_tokens.sample(rng.gauss(0.0, 1.0))
        path = [str(_zipf(rng, root_cum))]
        for _ in range(depth - 1):
            path.append(str(_zipf(rng, child_cum)))
        room = _room(f, out)
        depth = min(depth, room // f.block_tokens)
        # A block's id is its whole path: equal paths (prefixes) = equal bytes.
        shared = blocks.join(".".join(path[: k + 1]) for k in range(depth))
        tail = max(1, min(tail, room - depth * f.block_tokens))
        return _single(sid, source, f.model, "", shared + make_text(sid, tail), out)

    return make


def _read_trace(path: Path, f: PrefixTree) -> list[tuple[float, int, int, tuple[int, ...]]]:
    rows = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise WorkloadError(f"prefix-tree trace {path}: {exc}") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            row = (
                float(rec["timestamp"]) / 1000.0,
                int(rec["input_length"]),
                int(rec["output_length"]),
                tuple(int(h) for h in rec["hash_ids"]),
            )
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise WorkloadError(
                f"{path}:{lineno}: expected a Mooncake record (timestamp, input_length, "
                f"output_length, hash_ids): {exc}"
            ) from None
        if row[1] + max(1, row[2]) + _TEMPLATE_MARGIN_TOKENS <= f.max_context_tokens:
            rows.append(row)
    if len(rows) < 2:
        raise WorkloadError(f"{path}: fewer than 2 records fit max_context_tokens")
    return rows


def _trace_sessions(
    f: PrefixTree, path: Path, duration_s: float, sources: Sequence[str], seed: int
) -> list[Session]:
    """Replay the trace rows in order from a seeded start, scaled to ``rate_rps``."""
    rows = _read_trace(path, f)
    rng = random.Random(f"prefix-tree-trace/{seed}")
    span = rows[-1][0] - rows[0][0]
    mean_gap = span / (len(rows) - 1) if span > 0 else 1.0
    scale = 1.0 / (f.rate_rps * mean_gap)  # trace seconds -> mean-rate seconds
    start = rng.randrange(len(rows))
    bursty = f.burst_s > 0 and f.burst_factor > 1
    phase = rng.uniform(0.0, f.burst_every_s) if bursty else 0.0
    blocks = BlockTexts("block", f.block_tokens)
    sessions: list[Session] = []
    u = 0.0
    for i in itertools.count():
        j = (start + i) % len(rows)
        t_row, n_in, n_out, ids = rows[j]
        if i:
            prev = rows[(start + i - 1) % len(rows)][0]
            u += (t_row - prev if t_row >= prev else mean_gap) * scale
        t = u
        if bursty:
            args = (f.burst_every_s, f.burst_s, f.burst_factor, phase)
            t = burst_warp(u, *args) - burst_warp(0.0, *args)
        if t >= duration_s:
            break
        wrap = (start + i) // len(rows)
        user = max(1, n_in - CHAT_OVERHEAD_TOKENS)
        text = blocks.join(h + wrap * _TRACE_WRAP_ID_OFFSET for h in ids)
        sid = f"mooncake-{seed}-{i:06d}"
        if len(text) < user * BYTES_PER_TOKEN:
            text += make_text(f"{sid} tail", user - len(text) // BYTES_PER_TOKEN)
        text = text[: user * BYTES_PER_TOKEN]
        s = _single(sid, sources[i % len(sources)], f.model, "", text, max(1, n_out))
        sessions.append(msgspec.structs.replace(s, start_s=t))
    return sessions


def _rag_maker(f: Rag, seed: int) -> Maker:
    doc_rng = random.Random(f"rag-documents/{seed}")
    doc_tokens = [f.document_tokens.sample(doc_rng.gauss(0.0, 1.0)) for _ in range(f.documents)]
    # Popularity rank is not length rank: shuffle which document holds which rank.
    order = list(range(f.documents))
    doc_rng.shuffle(order)
    cum = _zipf_cum(f.documents, f.zipf_s)
    texts: dict[int, str] = {}

    def make(i: int, source: str, rng: random.Random) -> Session:
        sid = f"rag-{seed}-{i:06d}"
        out = f.output_tokens.sample(rng.gauss(0.0, 1.0))
        d = order[_zipf(rng, cum)]
        question = f.question_tokens.sample(rng.gauss(0.0, 1.0))
        room = _room(f, out)
        question = max(1, min(question, room - 1))
        document = texts.get(d)
        if document is None:
            document = texts[d] = make_text(f"document {d}", doc_tokens[d])
        # A document too long for this request is cut (a prefix of the same bytes).
        document = document[: (room - question) * BYTES_PER_TOKEN]
        return _single(sid, source, f.model, "", document + make_text(sid, question), out)

    return make


def _hot_maker(f: HotPrompt, seed: int) -> Maker:
    system = system_prompt_text("hot prompt", f.system_prompt_tokens)

    def make(i: int, source: str, rng: random.Random) -> Session:
        sid = f"hot-{seed}-{i:06d}"
        out = f.output_tokens.sample(rng.gauss(0.0, 1.0))
        user = f.user_tokens.sample(rng.gauss(0.0, 1.0))
        user = max(1, min(user, _room(f, out, f.system_prompt_tokens)))
        s = _single(sid, source, f.model, system, make_text(sid, user), out)
        return msgspec.structs.replace(s, tenant=f"tenant-{rng.randrange(f.tenants)}")

    return make


def _long_tail_tokens(f: LongTail, rng: random.Random) -> int:
    if f.distribution == "pareto":
        x_min = f.mean_tokens * (f.pareto_alpha - 1.0) / f.pareto_alpha
        value = x_min * rng.paretovariate(f.pareto_alpha)
    else:
        mu = math.log(f.mean_tokens) - f.sigma**2 / 2.0
        value = rng.lognormvariate(mu, f.sigma)
    return max(f.min_tokens, round(value))


def _long_tail_maker(f: LongTail, seed: int) -> Maker:
    n_system = f.system_prompt_tokens
    system = system_prompt_text("long tail", n_system) if n_system else ""

    def make(i: int, source: str, rng: random.Random) -> Session:
        sid = f"long-{seed}-{i:06d}"
        out = f.output_tokens.sample(rng.gauss(0.0, 1.0))
        n = min(_long_tail_tokens(f, rng), _room(f, out, n_system))
        return _single(sid, source, f.model, system, make_text(sid, n), out)

    return make


def _agentic_maker(f: Agentic, seed: int) -> Maker:
    system = system_prompt_text("agent tools", f.system_prompt_tokens)
    p_stop = 1.0 / f.mean_steps
    log_continue = math.log1p(-p_stop) if p_stop < 1.0 else None

    def make(i: int, source: str, rng: random.Random) -> Session:
        sid = f"agent-{seed}-{i:06d}"
        steps = 1 if log_continue is None else 1 + int(math.log(1.0 - rng.random()) / log_continue)
        steps = min(steps, f.max_steps)
        # Context so far, in tokens (replies counted at their re-rendered upper bound).
        ctx = f.system_prompt_tokens + CHAT_OVERHEAD_TOKENS + _TEMPLATE_MARGIN_TOKENS
        turns = []
        for k in range(steps):
            out = f.output_tokens.sample(rng.gauss(0.0, 1.0))
            ln = f.task_tokens if k == 0 else f.tool_output_tokens
            user = ln.sample(rng.gauss(0.0, 1.0))
            room = f.max_context_tokens - out - ctx - CHAT_OVERHEAD_TOKENS
            if user > room:
                if k:
                    break  # the loop ends before its context would overflow
                user = max(1, room)
            pause = rng.expovariate(1.0 / f.tool_time_s) if k and f.tool_time_s else 0.0
            tag = f"{sid} task" if k == 0 else f"{sid} tool output {k}"
            turns.append(
                Turn(
                    user_text=make_text(tag, user), user_tokens=user, max_tokens=out, think_s=pause
                )
            )
            ctx += user + CHAT_OVERHEAD_TOKENS + -(-out * _REPLY_BYTES_PER_TOKEN // BYTES_PER_TOKEN)
        return Session(
            session_id=sid,
            tenant="agents",
            source=source,
            model=f.model,
            start_s=0.0,
            system_prompt=system,
            turns=tuple(turns),
        )

    return make


_MAKERS: dict[type, Callable[[Family, int], Maker]] = {
    PrefixTree: _tree_maker,  # type: ignore[dict-item]
    Rag: _rag_maker,  # type: ignore[dict-item]
    HotPrompt: _hot_maker,  # type: ignore[dict-item]
    LongTail: _long_tail_maker,  # type: ignore[dict-item]
    Agentic: _agentic_maker,  # type: ignore[dict-item]
}


def _chat_sessions(f: Chat, duration_s: float, sources: Sequence[str], seed: int) -> list[Session]:
    w = msgspec.structs.replace(
        f.workload,
        models=(Weighted(name=f.model),),
        sources=tuple(Weighted(name=s) for s in sources),
    )
    per_session = requests_per_session(f, seed)
    w = msgspec.structs.replace(w, rate_sessions_per_s=f.rate_rps / per_session)
    sessions = generate_sessions(w, duration_s=duration_s + f.burst_every_s, seed=seed)
    if not (f.burst_s > 0 and f.burst_factor > 1):
        return [s for s in sessions if s.start_s < duration_s]
    rng = random.Random(f"chat-bursts/{seed}")
    phase = rng.uniform(0.0, f.burst_every_s)
    args = (f.burst_every_s, f.burst_s, f.burst_factor, phase)
    zero = burst_warp(0.0, *args)
    out = []
    for s in sessions:
        t = burst_warp(s.start_s, *args) - zero
        if t < duration_s:
            out.append(msgspec.structs.replace(s, start_s=t))
    return out


def requests_per_session(family: Family, seed: int = 0) -> float:
    """Mean requests per session (1 for the single-turn families; measured otherwise)."""
    if isinstance(family, Chat):
        w = msgspec.structs.replace(family.workload, rate_sessions_per_s=1.0)
        sample = generate_sessions(w, duration_s=float(_PROBE_SESSIONS), seed=seed + 7919)
        return sum(len(s.turns) for s in sample) / max(1, len(sample))
    if isinstance(family, Agentic):
        make = _agentic_maker(family, seed + 7919)
        rng = random.Random(f"agentic-probe/{seed}")
        sample = [make(i, "probe", rng) for i in range(_PROBE_SESSIONS)]
        return sum(len(s.turns) for s in sample) / len(sample)
    return 1.0


def family_sessions(
    family: Family,
    *,
    duration_s: float,
    sources: Sequence[str],
    seed: int,
    base_dir: str = "",
) -> list[Session]:
    """The family's sessions starting in ``[0, duration_s)``, sorted by start time.

    Requests arrive at ``family.rate_rps`` on average (multi-turn families: sessions at
    ``rate_rps`` / their measured requests per session); sources are assigned round
    robin; ``base_dir`` resolves a relative ``trace`` path.

    Raises
    ------
    WorkloadError
        ``duration_s`` not positive, no sources, or an unreadable trace.
    """
    if not duration_s > 0:
        raise WorkloadError(f"duration_s must be > 0, got {duration_s}")
    if not sources:
        raise WorkloadError("sources must not be empty")
    if isinstance(family, Chat):
        return _chat_sessions(family, duration_s, sources, seed)
    if isinstance(family, PrefixTree) and family.trace:
        path = Path(family.trace)
        if not path.is_absolute() and base_dir:
            path = Path(base_dir) / path
        return _trace_sessions(family, path, duration_s, sources, seed)
    kind = type(family).__struct_config__.tag
    rate = family.rate_rps / requests_per_session(family, seed)
    times = arrival_times(family, rate, duration_s, random.Random(f"{kind}-arrivals/{seed}"))
    make = _MAKERS[type(family)](family, seed)
    rng = random.Random(f"{kind}-requests/{seed}")
    return [
        msgspec.structs.replace(make(i, sources[i % len(sources)], rng), start_s=t)
        for i, t in enumerate(times)
    ]
