"""Generate multi-turn chat sessions from a :class:`~fastroute.workload.spec.ChatWorkload`.

Arrivals: each source ``s`` gets a renewal process of unit rate in *operational time*
(exponential gaps for ``"poisson"``, gamma gaps with the configured CV for ``"gamma"``),
mapped to wall time through ``Λ_s(t) = ∫₀ᵗ λ̄_s·m_s(u) du`` where ``m_s`` is the diurnal ×
burst multiplier. With ``m_s ≡ 1`` this is the plain process at rate ``λ̄_s``; otherwise
the rate follows the cycle while the gaps keep their shape (time rescaling).

Everything is drawn from :class:`random.Random` streams seeded from ``seed`` and the
source name, so the output depends only on (workload, duration, seed).
"""

from __future__ import annotations

import math
import random

import numpy as np

from fastroute.tokens import BYTES_PER_TOKEN
from fastroute.workload.session import Session, Turn, make_text, system_prompt_text
from fastroute.workload.spec import ChatWorkload, WorkloadError

__all__ = ["generate_sessions", "session_arrivals", "MAX_TURNS"]

#: Hard bound on turns per session (the geometric tail is cut here).
MAX_TURNS = 256
#: Upper bound on the bytes of one emulator output token re-rendered as text (its words
#: are at most 6 bytes); used to keep a session's context under max_context_tokens.
_REPLY_BYTES_PER_TOKEN = 6
# Rendered bytes of the chat template around messages (see fastroute.tokens).
_BOS_BYTES = len("<|begin_of_text|>")
_USER_PART_BYTES = len("<|start_header_id|>user<|end_header_id|>\n\n<|eot_id|>")
_SYSTEM_PART_BYTES = len("<|start_header_id|>system<|end_header_id|>\n\n<|eot_id|>")
_ASSISTANT_PART_BYTES = len("<|start_header_id|>assistant<|end_header_id|>\n\n<|eot_id|>")
_ASSISTANT_HEADER_BYTES = len("<|start_header_id|>assistant<|end_header_id|>\n\n")


def _pick(rng: random.Random, names: list[str], cum: list[float]) -> str:
    return names[min(len(names) - 1, _bisect(cum, rng.random() * cum[-1]))]


def _bisect(cum: list[float], x: float) -> int:
    lo, hi = 0, len(cum)
    while lo < hi:
        mid = (lo + hi) // 2
        if cum[mid] <= x:
            lo = mid + 1
        else:
            hi = mid
    return lo


def session_arrivals(
    workload: ChatWorkload, source: str, rate_per_s: float, duration_s: float, rng: random.Random
) -> list[float]:
    """Session start times of one source in ``[0, duration_s)``.

    Parameters
    ----------
    workload : ChatWorkload
        Supplies the arrival law and the diurnal/burst multipliers.
    source : str
        Source name (selects the diurnal phase and the bursts that apply).
    rate_per_s : float
        Mean rate of this source without multipliers.
    duration_s : float
        Length of the window.
    rng : random.Random
        Random stream.
    """
    if workload.arrival == "gamma":
        cv2 = workload.arrival_cv**2
        shape, scale = 1.0 / cv2, cv2

        def gap() -> float:
            return rng.gammavariate(shape, scale)
    else:

        def gap() -> float:
            return rng.expovariate(1.0)

    shaped = workload.diurnal is not None or any(
        not b.sources or source in b.sources for b in workload.bursts
    )
    if not shaped:
        out = []
        t = gap() / rate_per_s
        while t < duration_s:
            out.append(t)
            t += gap() / rate_per_s
        return out
    # Λ on a grid fine enough for the cycle and the burst edges, inverted by interpolation.
    step = 1.0
    if workload.diurnal is not None:
        step = min(step, workload.diurnal.period_s / 512)
    for b in workload.bursts:
        step = min(step, b.duration_s / 16)
    n = max(2, min(2_000_000, math.ceil(duration_s / step) + 1))
    grid = np.linspace(0.0, duration_s, n)
    mids = (grid[:-1] + grid[1:]) / 2
    mult = np.ones_like(mids)
    d = workload.diurnal
    if d is not None:
        phase = d.phase_s.get(source, 0.0)
        mult = 1.0 + d.amplitude * np.sin(2.0 * np.pi * (mids - phase) / d.period_s)
    for b in workload.bursts:
        if not b.sources or source in b.sources:
            inside = (mids >= b.start_s) & (mids < b.start_s + b.duration_s)
            mult = np.where(inside, mult * b.rate_multiplier, mult)
    cum = np.concatenate(([0.0], np.cumsum(mult * np.diff(grid) * rate_per_s)))
    units = []
    u = gap()
    while u < cum[-1]:
        units.append(u)
        u += gap()
    return [float(x) for x in np.interp(units, cum, grid)]


def generate_sessions(workload: ChatWorkload, *, duration_s: float, seed: int) -> list[Session]:
    """Sessions starting in ``[0, duration_s)``, sorted by start time.

    Parameters
    ----------
    workload : ChatWorkload
    duration_s : float
        Window in which sessions start (their later turns may run past it), > 0.
    seed : int
        Seed; equal seeds give equal sessions (ids, texts, times).

    Returns
    -------
    list of Session
        Ids ``"s{seed}-{index:06d}"`` in start order.

    Raises
    ------
    WorkloadError
        ``duration_s`` not positive.
    """
    if not duration_s > 0:
        raise WorkloadError(f"duration_s must be > 0, got {duration_s}")
    total_w = sum(s.weight for s in workload.sources)
    starts: list[tuple[float, int, str]] = []
    for si, src in enumerate(workload.sources):
        rng = random.Random(f"arrivals/{seed}/{src.name}")
        rate = workload.rate_sessions_per_s * src.weight / total_w
        starts.extend(
            (t, si, src.name) for t in session_arrivals(workload, src.name, rate, duration_s, rng)
        )
    starts.sort()

    tenants = list(workload.tenants)
    tenant_names = [t.name for t in tenants]
    tenant_cum = list(np.cumsum([t.weight for t in tenants]))
    system_text = {t.name: system_prompt_text(t.name, t.system_prompt_tokens) for t in tenants}
    model_names = [m.name for m in workload.models]
    model_cum = list(np.cumsum([m.weight for m in workload.models]))
    p_stop = 1.0 / workload.mean_turns
    log_continue = math.log1p(-p_stop) if p_stop < 1.0 else None
    max_ctx = workload.max_context_tokens
    rng = random.Random(f"sessions/{seed}")

    sessions = []
    for index, (start_s, _, source) in enumerate(starts):
        sid = f"s{seed}-{index:06d}"
        tenant = _pick(rng, tenant_names, tenant_cum)
        model = _pick(rng, model_names, model_cum)
        if log_continue is None:
            n_turns = 1
        else:
            n_turns = 1 + int(math.log(1.0 - rng.random()) / log_continue)
        n_turns = min(n_turns, MAX_TURNS)
        system = system_text[tenant]
        ctx_bytes = _BOS_BYTES + (len(system) + _SYSTEM_PART_BYTES if system else 0)
        turns = []
        for i in range(n_turns):
            user = workload.prompt_tokens.sample(rng.gauss(0.0, 1.0))
            out = workload.output_tokens.sample(rng.gauss(0.0, 1.0))
            think = (
                rng.expovariate(1.0 / workload.think_time_s) if i and workload.think_time_s else 0.0
            )
            prompt_bytes = ctx_bytes + _USER_PART_BYTES + _ASSISTANT_HEADER_BYTES
            room = max_ctx - out - (-(-prompt_bytes // BYTES_PER_TOKEN))
            if user > room:
                if i:
                    break  # the session ends before its context would overflow
                user = max(1, room)  # the first turn is trimmed to fit (validated to be possible)
            turns.append(
                Turn(
                    user_text=make_text(f"{sid} turn {i}", user),
                    user_tokens=user,
                    max_tokens=out,
                    think_s=think,
                )
            )
            ctx_bytes += (
                _USER_PART_BYTES
                + user * BYTES_PER_TOKEN
                + _ASSISTANT_PART_BYTES
                + out * _REPLY_BYTES_PER_TOKEN
            )
        sessions.append(
            Session(
                session_id=sid,
                tenant=tenant,
                source=source,
                model=model,
                start_s=start_s,
                system_prompt=system,
                turns=tuple(turns),
            )
        )
    return sessions
