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
    load = float(np.median(measured / predicted))
    shape_err = np.abs(load * predicted / measured - 1.0)
    detail = [(p["kind"], p.get("n", p.get("batch")), round(float(e), 3)) for p, e in
              zip(points, shape_err, strict=True)]  # fmt: skip
    assert LOAD_FACTOR_BOUNDS[0] < load < LOAD_FACTOR_BOUNDS[1], f"k = {load:.2f}: {detail}"
    p90 = float(np.percentile(shape_err, 90))
    print(f"\nload factor k = {load:.2f}, shape p90 {p90:.1%}: {detail}")
    assert p90 < SHAPE_P90_BOUND, f"k = {load:.2f}, p90 |error| {p90:.1%} over {detail}"
