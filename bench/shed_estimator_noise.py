"""Monte-Carlo of the controller's live demand estimate under Poisson arrivals.

Models ``controller/demand.py``'s ``forecast(held=False)``: ``max(EWMA, peak of the last
``peak_periods`` periods)`` of per-period Poisson counts, and the shed fraction
``1 - capacity / estimate`` it implies (``controller/weights.py`` ``shed_at_demand`` with the
LP routing exactly the capacity). The defaults are the workload families' fleet at 90 %:
0.9 × 4 × 0.58 req/s offered against 4 × 0.58 × ρ_max 0.95 req/s, 5 s periods.

    python bench/shed_estimator_noise.py
"""

from __future__ import annotations

import argparse

import numpy as np


def main() -> None:
    """Print the mean estimate and shed fraction of the shipped and EWMA-only estimators."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate-rps", type=float, default=0.9 * 4 * 0.58)
    ap.add_argument("--capacity-rps", type=float, default=4 * 0.58 * 0.95)
    ap.add_argument("--period-s", type=float, default=5.0)
    ap.add_argument("--alpha", type=float, default=0.3)
    ap.add_argument("--peak-periods", type=int, default=3)
    ap.add_argument("--periods", type=int, default=200_000)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    measured_rps = rng.poisson(a.rate_rps * a.period_s, a.periods) / a.period_s
    ewma_rps = np.empty(a.periods)
    ewma_rps[0] = a.rate_rps
    for i in range(1, a.periods):
        ewma_rps[i] = a.alpha * measured_rps[i] + (1 - a.alpha) * ewma_rps[i - 1]
    k = a.peak_periods
    windows = np.lib.stride_tricks.sliding_window_view(measured_rps, k)
    live_rps = np.maximum(ewma_rps[k - 1 :], windows.max(axis=1))
    for name, est in (("max(EWMA, peak)", live_rps), ("EWMA alone", ewma_rps)):
        shed = np.clip(1.0 - a.capacity_rps / est, 0.0, 1.0)
        print(
            f"{name:16s} mean estimate {est.mean():.2f} req/s (true {a.rate_rps:.2f}), "
            f"periods shedding {(shed > 0).mean():.0%}, mean shed fraction {shed.mean():.1%}"
        )


if __name__ == "__main__":
    main()
