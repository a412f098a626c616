"""The step-time profile measured on a real vLLM predicts a fresh real vLLM's steps.

``fastroute.predict.profiles.MEASURED`` holds the step-time constants that
``bench/calibrate_real_vllm.py`` fitted to a CPU vLLM serving the tiny Llama (docs/predict.md,
"Fit on a real vLLM"). Here the session's first engine (a fresh process, same core, same
flags but for its shorter context) is measured on three prefill lengths and three decode
batches with the same probe (vLLM's own timings), and the profile must predict them up to
a common load factor: if vLLM's scheduler or the model changes its cost structure, or the
features stop describing a step, the errors grow past the bound.
"""

from __future__ import annotations

import importlib
import sys

import numpy as np
import pytest
import real_harness as rh

from fastroute.predict.profiles import MEASURED

pytestmark = [pytest.mark.real, pytest.mark.timeout(rh.READY_TIMEOUT_S + 300)]

#: The profile under test.
PROFILE = "cpu-tiny-llama-vllm"
#: Samples per point (the minimum is kept): seven, as the calibration itself takes (≈ 50 s).
#: With five, the minimum's noise (below) reached the shape bound in CI (p90 20.1 %).
REPEATS = 7
#: Bounds on the common factor k = median(measured / predicted): the host's speed against the
#: host the profile was fitted on, times the load. Load slows every step alike to first order
#: (the calibration points at load average 10-15 were up to 1.5x the ones at load 4-5,
#: docs/predict.md "Fit on a real vLLM"), and the host's CPU sets the absolute step time: a
#: clean-clone CI run on another machine measured k = 0.47 (its engine 2.1x faster) with the
#: shape errors of a good fit (p90 18 %, max 19 %). The test is about the shape; k only has to
#: catch a gross error (a unit, a missing feature), which moves it by 10x or more.
LOAD_FACTOR_BOUNDS = (0.25, 4.0)
#: FACTOR_PER_KIND: prefill and decode get a factor each. A host's CPU does not speed both
#: alike: prefill is GEMM time (a1, a2), a decode step mostly framework overhead per step and
#: per sequence (b0, b1). On the profile's host the two factors were equal; on this session's CI
#: host measured/predicted was 0.48-0.56 for prefill and 0.37-0.41 for decode, a ratio of 1.33.
#: What carries over is the dependence on the prompt length and on the batch, which is what the
#: shape bound tests. On the committed points, per-kind factors leave the profile at a p90 of
#: 6.3 % and the emulator's a40 constants at 28.6 %, so the bound still catches them.
#: The ratio of the two factors is bounded too: beyond 2 the structure itself has changed.
KIND_RATIO_BOUND = 2.0
#: Bound on the p90 of |k · predicted / measured − 1|: the cost structure (prefill length
#: against decode batch). On the calibration's own points the profile's shape error has a
#: p90 of 5 % (min of 7); a min of 5 is noisier: the 2nd-smallest of a point's 7 samples was
#: up to 16 % (median 4 %) above its smallest, the 3rd-smallest up to 19 %. 20 % is above
#: that noise and catches a change of the structure of that size: on the committed points the
#: emulator's a40 constants give 25 % (27 % on a fresh engine), the profile without its b1
#: 22 %, without a2 15 % (not caught). A fresh engine with 3 repeats gave 15 %.
SHAPE_P90_BOUND = 0.20


def _probe_module():
    sys.path.insert(0, str(rh.HERE.parent.parent / "bench"))
    return importlib.import_module("calibrate_real_vllm")


def test_measured_profile_predicts_a_fresh_engine(vllm_engines: list[rh.Running]) -> None:
    calib = _probe_module()
    probe = calib.Probe(vllm_engines[0].url, rh.MODEL)
    points = calib.measure(probe, REPEATS, quick=True)
    assert {p["kind"] for p in points} == {"prefill", "decode"} and len(points) == 6
    coef = np.asarray(MEASURED[PROFILE].coef())
    predicted = np.array([coef @ calib.point_features(p) for p in points])
    measured = np.array([p["engine_s"] for p in points])
    ratio = measured / predicted
    kinds = np.array([p["kind"] for p in points])
    shape_err = np.empty_like(ratio)
    factors = {}
    for kind in ("prefill", "decode"):  # one factor per kind: see FACTOR_PER_KIND
        mine = kinds == kind
        factors[kind] = float(np.median(ratio[mine]))
        shape_err[mine] = np.abs(factors[kind] / ratio[mine] - 1.0)
    detail = [(p["kind"], p.get("n", p.get("batch")), round(float(r), 3), round(float(e), 3))
              for p, r, e in zip(points, ratio, shape_err, strict=True)]  # fmt: skip
    for kind, k in factors.items():
        assert LOAD_FACTOR_BOUNDS[0] < k < LOAD_FACTOR_BOUNDS[1], f"{kind} k = {k:.2f}: {detail}"
    between = factors["prefill"] / factors["decode"]
    assert 1 / KIND_RATIO_BOUND < between < KIND_RATIO_BOUND, f"k ratio {between:.2f}: {detail}"
    p90 = float(np.percentile(shape_err, 90))
    print(
        f"\nfactors {factors}, shape p90 {p90:.1%}: (kind, n|B, measured/predicted, error) {detail}"
    )
    assert p90 < SHAPE_P90_BOUND, f"factors {factors}, p90 |error| {p90:.1%} over {detail}"
