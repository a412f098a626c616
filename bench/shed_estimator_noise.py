"""Monte-Carlo of the controller's shed estimate under Poisson arrivals.

Models ``controller/demand.py``: per-period Poisson counts, their EWMA (``level()``, what
shed fractions read) and ``max(EWMA, peak of the last peak_periods periods)`` (``forecast()``,
what the LP plans for and what shed fractions read before 2026-12-03), and the shed fraction
``1 - capacity / estimate`` each implies (``controller/weights.py`` ``shed_at_demand`` with
the LP routing exactly the capacity), against the ideal ``max(0, 1 - capacity / rate)``.
The defaults are the workload families' fleet: offered loads × 4 × 0.58 req/s against
4 × 0.58 × ρ_max 0.95 req/s, 5 s periods.

    python bench/shed_estimator_noise.py
    python bench/shed_estimator_noise.py --alpha 0.1   # the EWMA weight's sensitivity
"""

from __future__ import annotations

import argparse

import numpy as np


def _estimates(a: argparse.Namespace, rate_rps: float, rng: np.random.Generator) -> dict:
    measured_rps = rng.poisson(rate_rps * a.period_s, a.periods) / a.period_s
    ewma_rps = np.empty(a.periods)
    ewma_rps[0] = rate_rps
    for i in range(1, a.periods):
        ewma_rps[i] = a.alpha * measured_rps[i] + (1 - a.alpha) * ewma_rps[i - 1]
    k = a.peak_periods
    windows = np.lib.stride_tricks.sliding_window_view(measured_rps, k)
    return {
        "EWMA (level)": ewma_rps[k - 1 :],
        "max(EWMA, peak)": np.maximum(ewma_rps[k - 1 :], windows.max(axis=1)),
    }


def main() -> None:
    """Print, per offered load, each estimator's mean estimate and mean shed fraction."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", type=float, nargs="+", default=[0.7, 0.9, 1.0, 1.1, 1.3, 1.6])
    ap.add_argument("--engine-rps", type=float, default=4 * 0.58)
    ap.add_argument("--rho-max", type=float, default=0.95)
    ap.add_argument("--period-s", type=float, default=5.0)
    ap.add_argument("--alpha", type=float, default=0.3)
    ap.add_argument("--peak-periods", type=int, default=3)
    ap.add_argument("--periods", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    capacity_rps = a.engine_rps * a.rho_max
    for load in a.loads:
        rate_rps = load * a.engine_rps
        ideal = max(0.0, 1.0 - capacity_rps / rate_rps)
        print(f"load {load:.0%}: {rate_rps:.2f} req/s, ideal shed {ideal:.1%}")
        for name, est in _estimates(a, rate_rps, rng).items():
            shed = np.clip(1.0 - capacity_rps / est, 0.0, 1.0)
            print(
                f"  {name:16s} mean estimate {est.mean():.2f} req/s, "
                f"periods shedding {(shed > 0).mean():4.0%}, mean shed fraction {shed.mean():5.1%}"
            )


if __name__ == "__main__":
    main()
