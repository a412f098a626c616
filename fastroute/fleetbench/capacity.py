"""One engine's SLO capacity for a workload, in virtual time (no processes, no I/O).

"70 % / 90 % of fleet capacity" needs a capacity. :func:`slo_capacity_rps` replays
the workload's sessions (multi-turn, think times, prefix caching) against one
:class:`~fastroute.emulator.model.EngineModel` — the emulator's own performance model
— at a given request rate, and bisects for the highest rate at which at least
``attainment`` of the requests meet both SLOs (TTFT and TBOT, measured at the engine,
so no network or router time). The benchmark specs' ``capacity_rps`` come from
``fastroute bench capacity SPEC``.

This is the *SLO* capacity with prefix reuse; the simulator plans with the
*saturation* capacity without it (:mod:`fastroute.sim.capacity`). Both run the same
replay loop, :func:`fastroute.emulator.model.replay` (one engine, FCFS arrivals); the
discrete-event simulator (``fastroute.sim``) is the general tool.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["EngineRun", "replay_at_rate", "slo_capacity_rps", "turns_per_session"]


class EngineRun(msgspec.Struct, kw_only=True):
    """Outcome of one replay: requests served, refused, and SLO attainment."""

    rate_rps: float
    requests: int
    refused: int
    slo_attainment: float
    ttft_p90_s: float | None
    tbot_p90_s: float | None


def turns_per_session(workload: Any, seed: int = 0) -> float:
    """Mean turns per session of ``workload`` (measured on a long sample)."""
    from fastroute.workload import generate_sessions

    probe = msgspec.structs.replace(workload, rate_sessions_per_s=1.0)
    sample = generate_sessions(probe, duration_s=2000.0, seed=seed + 7919)
    return sum(len(s.turns) for s in sample) / max(1, len(sample))


def _p90(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, int(0.9 * len(ordered) + 0.999999) - 1)]


def replay_at_rate(
    profile: str,
    workload: Any,
    *,
    rate_rps: float,
    duration_s: float,
    ttft_slo_s: float,
    tbot_slo_s: float,
    seed: int = 0,
    max_num_seqs: int = 256,
) -> EngineRun:
    """Play ``workload`` at ``rate_rps`` requests/s into one emulated engine in virtual time.

    Closed-loop sessions through :func:`fastroute.emulator.model.replay`: a turn's reply
    joins its session's context and its next turn arrives a think time after it finishes.
    """
    from fastroute.emulator.model import EngineConfig, EngineModel, Request, replay
    from fastroute.hardware import get_profile
    from fastroute.workload import SessionPrompts, generate_sessions
    from fastroute.workload.session import reply_text

    wl = msgspec.structs.replace(
        workload, rate_sessions_per_s=rate_rps / turns_per_session(workload, seed)
    )
    sessions = generate_sessions(wl, duration_s=duration_s, seed=seed)
    model = EngineModel(get_profile(profile), EngineConfig(max_num_seqs=max_num_seqs), seed=seed)
    prompts = [SessionPrompts(s) for s in sessions]
    turn_of: dict[str, tuple[int, int]] = {}
    met = served = refused = 0
    ttfts: list[float] = []
    tbots: list[float] = []

    def request(i: int, k: int) -> Request:
        prompt = prompts[i].prompt(k)
        turn_of[f"{i}/{k}"] = (i, k)
        return Request(f"{i}/{k}", prompt.num_tokens, prompt.block_hashes,
                       output_tokens=sessions[i].turns[k].max_tokens)  # fmt: skip

    def on_finished(req: Request) -> list[tuple[float, Request]]:
        nonlocal met, served
        i, k = turn_of.pop(req.request_id)
        served += 1
        assert req.first_token_s is not None and req.last_token_s is not None
        assert req.arrival_s is not None and req.finish_s is not None
        ttft = req.first_token_s - req.arrival_s
        tbot = 0.0
        if req.output_tokens > 1:
            tbot = (req.last_token_s - req.first_token_s) / (req.output_tokens - 1)
            tbots.append(tbot)
        ttfts.append(ttft)
        met += ttft <= ttft_slo_s and tbot <= tbot_slo_s
        session = sessions[i]
        prompts[i].add_reply(k, reply_text(session.session_id, k, req.output_tokens))
        if k + 1 < len(session.turns):
            return [(req.finish_s + session.turns[k + 1].think_s, request(i, k + 1))]
        return []

    def on_refused(req: Request) -> None:
        nonlocal refused
        turn_of.pop(req.request_id)
        refused += 1

    arrivals = [(s.start_s, request(i, 0)) for i, s in enumerate(sessions)]
    replay(model, arrivals, max_steps=50_000_000, on_finished=on_finished, on_refused=on_refused)
    total = served + refused
    return EngineRun(
        rate_rps=rate_rps,
        requests=total,
        refused=refused,
        slo_attainment=met / total if total else 1.0,
        ttft_p90_s=_p90(ttfts),
        tbot_p90_s=_p90(tbots),
    )


def slo_capacity_rps(
    profile: str,
    workload: Any,
    *,
    ttft_slo_s: float,
    tbot_slo_s: float,
    attainment: float = 0.9,
    duration_s: float = 300.0,
    seed: int = 0,
    hi_rps: float = 64.0,
    iterations: int = 10,
) -> float:
    """SLO capacity: the highest request rate (req/s) at which ≥ ``attainment`` of requests
    meet both SLOs, sessions keeping their prefix-cache reuse.

    Not the simulator's saturation capacity
    (:func:`fastroute.sim.capacity.saturation_capacity_rps`, no cache reuse, no SLO).
    """
    lo, hi = 0.0, hi_rps
    for _ in range(iterations):
        mid = (lo + hi) / 2
        run = replay_at_rate(
            profile, workload, rate_rps=mid, duration_s=duration_s,
            ttft_slo_s=ttft_slo_s, tbot_slo_s=tbot_slo_s, seed=seed,
        )  # fmt: skip
        if run.slo_attainment >= attainment:
            lo = mid
        else:
            hi = mid
    return lo
