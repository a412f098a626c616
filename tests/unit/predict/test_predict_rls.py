"""RobustRLS and the step-time model on synthetic timings: recovery, drift, spikes, wind-up."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fastroute.hardware import get_profile
from fastroute.predict import (
    COEF_NAMES,
    NominalStepTimes,
    RobustRLS,
    StepTimeModel,
    decode_features,
    prefill_features,
)

TRUE = NominalStepTimes.from_profile(get_profile("a40"))
# Identifiable from a few thousand samples at 5 % noise (a2, a3 are a few % of a prefill).
WELL_DETERMINED = ("a0_s", "b0_s", "b1_s", "b2_s", "a1_s")


def synthetic(rand, n: int, *, noise: float = 0.05, spikes: float = 0.01, drift_at: int = -1):
    """Prefill-only and decode-only phases of an A40 engine with lognormal noise, ×3 spikes
    and an optional +15 % drift: ``[(features, time_s, kind), ...]``."""
    out = []
    coef = TRUE.coef()
    for t in range(n):
        if rand.random() < 0.5:
            tokens = rand.randint(1, 2 * TRUE.max_num_batched_tokens)
            cached = 0 if rand.random() < 0.5 else rand.randint(0, 4096)
            f, kind = (
                prefill_features(tokens, cached, budget=TRUE.max_num_batched_tokens),
                "prefill",
            )
        else:
            batch = rand.randint(1, 256)
            f, kind = decode_features(batch, batch * rand.randint(64, 4096)), "decode"
        y = sum(a * b for a, b in zip(coef, f, strict=True)) * math.exp(rand.gauss(0.0, noise))
        if 0 <= drift_at <= t:
            y *= 1.15
        if rand.random() < spikes:
            y *= 3.0
        out.append((f, y, kind))
    return out


def median_ape(model: StepTimeModel, data) -> float:
    return float(np.median([abs(model.predict(f) / y - 1.0) for f, y, _ in data]))


def test_recovers_known_coefficients_from_noisy_timings(rand):
    """From nominal constants 1.6x off, 3000 noisy samples (5 % noise, 1 % x3 spikes) give
    the well-determined coefficients within 10 % and held-out median error near the noise."""
    model = StepTimeModel(TRUE.scaled(1.6))
    before = median_ape(model, synthetic(rand, 300, spikes=0.0))
    for f, y, kind in synthetic(rand, 3000):
        model.observe(f, y, kind=kind)
    coef = dict(zip(COEF_NAMES, model.rls.coef, strict=True))
    for name in WELL_DETERMINED:
        assert coef[name] == pytest.approx(getattr(TRUE, name), rel=0.10), name
    held_out = synthetic(rand, 400, spikes=0.0)
    after = median_ape(model, held_out)
    assert before > 0.3  # the nominal constants really were off
    assert after < 0.06  # noise floor: median |e^z - 1| at 5 % is 3.4 %


def test_tracks_a_drift(rand):
    """A +15 % slowdown at sample 2000: error jumps, then recovers within a few hundred."""
    model = StepTimeModel(TRUE)
    data = synthetic(rand, 2800, spikes=0.0, drift_at=2000)
    errors = []
    for f, y, kind in data:
        errors.append(abs(model.predict(f) / y - 1.0))
        model.observe(f, y, kind=kind)
    settled = np.median(errors[1700:2000])
    just_after = np.median(errors[2000:2050])
    recovered = np.median(errors[2500:2800])
    assert just_after > 2 * settled
    assert recovered < 0.06
    assert model.rls.coef[1] == pytest.approx(1.15 * TRUE.b0_s, rel=0.08)  # b0 followed


def test_huber_weights_resist_spikes(rand):
    """With 5 % of samples x3, the robust fit beats the same fit without Huber weights."""
    data = synthetic(rand, 2500, spikes=0.05)
    clean = synthetic(rand, 400, spikes=0.0)
    robust = StepTimeModel(TRUE.scaled(1.3))
    plain = StepTimeModel(TRUE.scaled(1.3))
    plain.rls.huber_k = 1e9  # every sample at full weight
    for f, y, kind in data:
        robust.observe(f, y, kind=kind)
        plain.observe(f, y, kind=kind)
    assert median_ape(robust, clean) < 0.06
    assert median_ape(robust, clean) < 0.7 * median_ape(plain, clean)
    assert robust.rls.weight_sum < robust.rls.n_samples  # spikes were down-weighted


def test_unexcited_coefficients_do_not_wind_up(rand):
    """Thousands of decode-only samples leave the prefill coefficients where they were and
    keep their information above the stabilising floor (no lambda^-t blow-up), so the next
    prefill sample moves them sanely."""
    model = StepTimeModel(TRUE)
    for f, y, kind in synthetic(rand, 6000, spikes=0.0):
        if kind == "decode":
            model.observe(f, y, kind=kind)
    rls = model.rls
    prefill_idx = [0, 4, 5, 6]
    floor = rls._r_floor / (1.0 - rls.forgetting)
    assert np.all(np.diagonal(rls.R)[prefill_idx] >= floor[prefill_idx] * 0.99)
    assert rls.coef[4] == pytest.approx(TRUE.a1_s, rel=1e-9)
    f = prefill_features(1000, 0, budget=TRUE.max_num_batched_tokens)
    model.observe(f, model.predict(f) * 1.05, kind="prefill")
    assert model.rls.coef[4] == pytest.approx(TRUE.a1_s, rel=0.2)


def test_collinear_noise_free_data_stays_stable():
    """Closed-loop failure case: a steady batch (B and S move together), exact timings and
    a slightly wrong sample now and then. The decode coefficients must stay sane."""
    model = StepTimeModel(TRUE)
    coef = TRUE.coef()
    for t in range(20_000):
        batch = 8 + (t // 500) % 3
        context = batch * 700 + (t % 500) * batch
        f = decode_features(batch, context)
        y = sum(a * b for a, b in zip(coef, f, strict=True))
        model.observe(f, y * (1.03 if t % 97 == 0 else 1.0), kind="decode")
    for name, got in zip(COEF_NAMES[1:4], model.rls.coef[1:4], strict=True):
        assert got == pytest.approx(getattr(TRUE, name), rel=0.5), name
    f = decode_features(64, 64 * 3000)  # far outside the data: still a sane prediction
    assert model.predict(f) == pytest.approx(
        sum(a * b for a, b in zip(coef, f, strict=True)), rel=0.25
    )


def test_exact_linear_fit_and_out_of_sample_residual():
    """Noise-free data: RLS converges to the exact coefficients; update returns the error
    of the prediction made before it saw the sample."""
    rls = RobustRLS([1.0, 1.0], [1.0, 1.0], forgetting=1.0)
    rng = np.random.default_rng(3)
    first = rls.update([1.0, 2.0], 0.5 + 0.25 * 2.0)
    assert first == pytest.approx((1.0 - 3.0) / 3.0)
    for x in rng.uniform(0.0, 10.0, 300):
        rls.update([1.0, float(x)], 0.5 + 0.25 * x)
    assert rls.coef == pytest.approx([0.5, 0.25], rel=1e-4)  # the prior never fades at λ = 1
    assert rls.predict_list([1.0, 4.0]) == pytest.approx(1.5, rel=1e-4)


def test_bad_inputs_are_rejected():
    """Non-finite observations, wrong lengths and bad settings raise ValueError."""
    rls = RobustRLS([1.0, 1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="finite"):
        rls.update([1.0, 1.0], float("nan"))
    with pytest.raises(ValueError, match="expected 2 features"):
        rls.update([1.0], 1.0)
    with pytest.raises(ValueError, match="forgetting"):
        RobustRLS([1.0], [1.0], forgetting=0.0)
    model = StepTimeModel(TRUE)
    with pytest.raises(ValueError, match="kind"):
        model.observe(decode_features(1, 10), 0.01, kind="mixed")
    with pytest.raises(ValueError, match="positive"):
        model.observe(decode_features(1, 10), 0.0)


def test_uncalibrated_model_ignores_observations(rand):
    """calibrate=False keeps the nominal constants whatever it is shown."""
    nominal = TRUE.scaled(2.0)
    model = StepTimeModel(nominal, calibrate=False)
    for f, y, kind in synthetic(rand, 200):
        model.observe(f, y, kind=kind, engine_id=1)
    assert model.rls.coef == pytest.approx(nominal.coef())
    assert model.rls.n_samples == 0 and model.residual(1, "prefill") == 1.0
