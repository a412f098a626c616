"""Where a policy's goodput goes past saturation, per engine (simulator).

    python bench/saturation_breakdown.py --family rag --load 4 \
      --routers prefix-hrw,cache-aware --seeds 1,2 [--set control.optimiser=lp]

For each router and seed, one run of the family's scenario (``bench/policy_matrix.py``'s
cells: 1 worker × 1 proxy), then, from the served requests that arrived after the warm-up:
the SLO misses by kind (TTFT, TBOT, both), the prompt tokens prefilled (not found in the
engine's prefix cache), and per engine the requests served, its TBOT misses and its decode
batch (requests past their first token, time-averaged over the window: the sum of their
decode times over the window's length). docs/fleet-benchmark.md, "What remains, second
look", quotes it.
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from policy_matrix import FAMILY_DIR, _setting, scenario_of


def breakdown(records: Iterable[Any], slo: Any, warmup_s: float, window_s: float) -> dict:
    """Misses by kind, prefilled prompt tokens and the per-engine figures of ``records``
    (``RequestRecord``) arriving at or after ``warmup_s``."""
    misses: Counter[str] = Counter()
    served: Counter[str] = Counter()
    tbot_misses: Counter[str] = Counter()
    decode_s: Counter[str] = Counter()
    prefilled = 0
    for r in records:
        if r.arrival_s < warmup_s or r.outcome != "ok":
            continue
        late = r.ttft_s > slo.ttft_s
        slow = r.tbot_s is not None and r.tbot_s > slo.tbot_s
        misses[{(True, True): "both", (True, False): "ttft", (False, True): "tbot"}.get(
            (late, slow), "met")] += 1  # fmt: skip
        served[r.engine] += 1
        tbot_misses[r.engine] += slow
        decode_s[r.engine] += r.finish_s - r.first_token_s
        prefilled += r.prompt_tokens - max(r.cached_tokens, 0)
    engines = sorted(served)
    return {
        "misses": dict(misses),
        "prefilled_tokens": prefilled,
        "engines": {
            e: {
                "served": served[e],
                "tbot_misses": tbot_misses[e],
                "decode_batch": decode_s[e] / window_s,
            }
            for e in engines
        },
    }


def run(family: str, load: float, router: str, seed: int, settings: dict[str, Any]) -> dict:
    """One simulator run of ``family`` (a name or a scenario path) and its breakdown."""
    from fastroute.sim import Simulator
    from fastroute.sim.scenario import load_scenario

    path = scenario_of(family)[1]
    scenario = load_scenario(
        path, {"target_load": load, "dataplane.workers": 1, "dataplane.proxies": 1, **settings}
    )
    result = Simulator(scenario, policy=router, seed=seed).run()
    window_s = scenario.duration_s - scenario.warmup_s
    return breakdown(result.records, scenario.slo, scenario.warmup_s, window_s)


def lines(router: str, seed: int, figures: dict) -> list[str]:
    """The printed summary of one run."""
    out = [
        f"{router} seed {seed}: misses {figures['misses']}, "
        f"prefilled {figures['prefilled_tokens'] / 1e3:.0f} k tokens"
    ]
    for name, e in figures["engines"].items():
        out.append(
            f"  {name}: served {e['served']}, TBOT misses {e['tbot_misses']}, "
            f"decode batch {e['decode_batch']:.1f}"
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="rag", help=f"a name under {FAMILY_DIR} or a .toml path")
    ap.add_argument("--load", type=float, default=4.0)
    ap.add_argument("--routers", default="prefix-hrw,cache-aware")
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--set", type=_setting, action="append", default=[])
    args = ap.parse_args(argv)
    settings = dict(args.set)
    for seed in (int(s) for s in args.seeds.split(",")):
        for router in args.routers.split(","):
            figures = run(args.family, args.load, router, seed, settings)
            print("\n".join(lines(router, seed, figures)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
