"""The TTFT floor of a fleet-benchmark spec: each request's prefill alone on an empty engine.

    python bench/ttft_floor.py examples/bench/families/mooncake-90.toml [more specs]

No router can give a request a first token sooner than its own prefill on an idle engine,
so this bounds what any router can reach on the spec's workload: the share of the measured
window's requests that miss the TTFT SLO even alone (the goodput ceiling is at most one
minus it) and the percentiles of that solo prefill time (the p99 TTFT floor). The prefill is
the engine profile's step model (``HardwareProfile.prefill_time_s``) over chunks of its
``default_max_num_batched_tokens``, each chunk over the context computed before it, no prefix
cached, no decode in the batch. Prompt tokens are the emulator's count (UTF-8 bytes / 4) of
the system prompt and the first user turn; later turns carry replies not known in advance,
so a multi-turn session contributes its first turn only. Nothing is cached, so the floor
is strict only where little is shared (mooncake: every router's engine hit rate is under
6 %); a prefix cached at the engine shortens the prefill below it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from fastroute.fleetbench.runner import build_sessions
from fastroute.fleetbench.spec import BenchSpec, load_spec
from fastroute.hardware import HardwareProfile, get_profile
from fastroute.tokens import count_text_tokens


def solo_prefill_s(profile: HardwareProfile, prompt_tokens: int) -> float:
    """Seconds to prefill ``prompt_tokens`` alone, chunk by chunk, nothing cached."""
    budget = profile.default_max_num_batched_tokens
    done, total_s = 0, 0.0
    while done < prompt_tokens:
        chunk = min(budget, prompt_tokens - done)
        total_s += profile.prefill_time_s(chunk, done)
        done += chunk
    return total_s


def floor(spec: BenchSpec) -> dict[str, float]:
    """The measured window's first turns: count, prompt-token and solo-prefill percentiles,
    and the share whose solo prefill exceeds the TTFT SLO."""
    sessions, _, _ = build_sessions(spec)
    profile = get_profile(spec.fleet.groups[0].profile)
    window = [s for s in sessions if spec.warmup_s <= s.start_s < spec.warmup_s + spec.duration_s]
    tokens = np.array(
        [count_text_tokens(s.system_prompt + s.turns[0].user_text) for s in window], dtype=float
    )
    solo_s = np.array([solo_prefill_s(profile, int(n)) for n in tokens])
    return {
        "requests": float(len(window)),
        "prompt_tokens_p50": float(np.percentile(tokens, 50)),
        "prompt_tokens_p99": float(np.percentile(tokens, 99)),
        "solo_ttft_p50_s": float(np.percentile(solo_s, 50)),
        "solo_ttft_p99_s": float(np.percentile(solo_s, 99)),
        "share_over_slo": float(np.mean(solo_s > spec.slo.ttft_s)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="+", type=Path)
    args = ap.parse_args()
    print(
        "| spec | first turns | prompt tokens p50 / p99 | solo TTFT p50 / p99 s "
        "| share over the TTFT SLO alone |"
    )
    print("|---|---|---|---|---|")
    for path in args.specs:
        spec = load_spec(path)
        f = floor(spec)
        print(
            f"| {spec.name} | {f['requests']:.0f} "
            f"| {f['prompt_tokens_p50']:.0f} / {f['prompt_tokens_p99']:.0f} "
            f"| {f['solo_ttft_p50_s']:.2f} / {f['solo_ttft_p99_s']:.2f} "
            f"| {f['share_over_slo'] * 100:.1f} % |"
        )


if __name__ == "__main__":
    main()
