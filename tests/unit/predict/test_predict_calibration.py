"""FleetCalibration: per-engine residuals, KV transfer, export and publication to a new worker."""

from __future__ import annotations

import math

import msgspec
import pytest

from fastroute.emulator.model import EngineConfig
from fastroute.hardware import get_profile
from fastroute.predict import (
    COEF_NAMES,
    CalibrationSnapshot,
    FleetCalibration,
    NominalStepTimes,
    decode_features,
)

A40 = get_profile("a40")


def feed(cal: FleetCalibration, rand, n: int, slow: dict[int, float]) -> None:
    """Decode steps and prefills on engines 1..4, engine e ``slow[e]`` times slower."""
    for _ in range(n):
        engine = rand.randint(1, 4)
        factor = slow.get(engine, 1.0) * math.exp(rand.gauss(0.0, 0.03))
        if rand.random() < 0.5:
            batch = rand.randint(1, 128)
            ctx = batch * rand.randint(100, 3000)
            cal.observe_decode("a40", engine, batch, ctx, A40.decode_time_s(batch, ctx) * factor)
        else:
            tokens = rand.randint(10, 2000)
            cal.observe_prefill("a40", engine, tokens, 0, A40.prefill_time_s(tokens) * factor)


def test_one_slow_engine_gets_a_residual_not_its_type(rand):
    """Engine 3 is 1.3x slower: its residual says so; the type fit stays near the truth."""
    cal = FleetCalibration()
    feed(cal, rand, 3000, {3: 1.3})
    model = cal.model("a40")
    ratio = model.residual(3, "decode") / model.residual(1, "decode")
    assert model.residual(3, "prefill") / model.residual(1, "prefill") == pytest.approx(
        1.3, rel=0.05
    )
    assert ratio == pytest.approx(1.3, rel=0.05)
    f = decode_features(32, 32 * 1000)
    truth = A40.decode_time_s(32, 32 * 1000)
    assert model.predict(f, 3) == pytest.approx(1.3 * truth, rel=0.05)
    assert model.predict(f, 1) == pytest.approx(truth, rel=0.05)


def test_snapshot_round_trips_and_starts_a_new_worker_calibrated(rand):
    """A worker loading a published snapshot predicts like the one that learned it."""
    start = NominalStepTimes.from_profile(A40).scaled(1.8)  # far-off nominal constants
    learned = FleetCalibration({"a40": start})
    feed(learned, rand, 2000, {})
    wire = msgspec.json.encode(learned.snapshot())
    snapshot = msgspec.json.decode(wire, type=CalibrationSnapshot)
    fresh = FleetCalibration({"a40": start})
    f = decode_features(16, 16 * 500)
    assert fresh.model("a40").predict(f) == pytest.approx(1.8 * A40.decode_time_s(16, 8000))
    fresh.load(snapshot)
    assert fresh.model("a40").predict(f) == pytest.approx(learned.model("a40").predict(f), rel=1e-9)
    assert fresh.model("a40").samples_by_kind == learned.model("a40").samples_by_kind
    # and it is not thrown away by its first local samples
    fresh.observe_decode("a40", 9, 16, 8000, A40.decode_time_s(16, 8000) * 1.5)
    assert fresh.model("a40").predict(f) == pytest.approx(A40.decode_time_s(16, 8000), rel=0.05)


def test_to_dict_exposes_coefficients_counts_and_errors(rand):
    """The plain dict for /metrics and decision records."""
    cal = FleetCalibration()
    feed(cal, rand, 100, {})
    d = cal.to_dict()
    a40 = d["types"]["a40"]
    assert set(a40["coef"]) == set(COEF_NAMES)
    assert a40["n_samples"] == 100 and a40["calibrate"] is True
    kinds = a40["samples_by_kind"]
    assert set(kinds) == {"prefill", "decode"} and sum(kinds.values()) == 100
    assert 0 < a40["abs_rel_err"] < 0.2
    assert set(a40["p90_factor"]) == {"prefill", "decode"}
    assert set(a40["residuals"]) == {"prefill", "decode"}
    assert all(isinstance(k, str) for k in a40["residuals"]["decode"])  # JSON-ready ids
    assert d["transfer"]["n_samples"] == 0


def test_kv_transfer_model_learns_latency_and_bandwidth(rand):
    """From nominal one-NIC figures to a link 2.5x slower with a 3 ms handshake."""
    cal = FleetCalibration()
    cfg = EngineConfig()
    nominal = cal.transfer.predict_s(4000)
    assert nominal == pytest.approx(
        cfg.kv_transfer_latency_s + 4000 * A40.kv_bytes_per_token / cfg.kv_transfer_bandwidth_Bps
    )
    per_token = 2.5 * A40.kv_bytes_per_token / cfg.kv_transfer_bandwidth_Bps
    for _ in range(600):
        tokens = rand.randint(16, 8000)
        cal.observe_transfer(tokens, (3e-3 + per_token * tokens) * math.exp(rand.gauss(0, 0.03)))
    state = cal.transfer.state()
    assert state.s_per_token == pytest.approx(per_token, rel=0.05)
    assert cal.transfer.predict_s(4000) == pytest.approx(3e-3 + per_token * 4000, rel=0.05)


def test_uncalibrated_fleet_keeps_nominal_constants(rand):
    """calibrate=False: observations change nothing (the baseline of the experiments)."""
    cal = FleetCalibration(calibrate=False)
    before = cal.model("a40").rls.coef
    feed(cal, rand, 200, {2: 2.0})
    cal.observe_transfer(100, 1.0)
    assert cal.model("a40").rls.coef == before
    assert cal.to_dict()["types"]["a40"]["calibrate"] is False
    assert cal.transfer.state().n_samples == 0


def test_unknown_types_start_from_the_default_or_their_profile():
    """'h100' starts from the emulator's H100 profile, an unknown name from the default."""
    cal = FleetCalibration(default_type="a40")
    assert cal.model("h100").nominal.b0_s == pytest.approx(get_profile("h100").b0_s)
    assert cal.model("mystery").nominal.b0_s == pytest.approx(A40.b0_s)
    with pytest.raises(ValueError, match="unknown default engine type"):
        FleetCalibration(default_type="nope")


def test_numpy_observations_export_as_plain_data():
    import msgspec
    import numpy as np

    from fastroute.predict import FleetCalibration

    cal = FleetCalibration()
    for n in (128, 512, 1024, 2048):
        cal.observe_prefill("a40", np.int64(7), n, 0, np.float64(0.01 + n * 1e-5))
        cal.observe_decode("a40", np.int64(7), 8, 4096, np.float32(0.02))
    exported = cal.to_dict()
    assert msgspec.json.encode(exported)  # raises TypeError on a numpy scalar in the state


def _mixed_tbot(rand, m1_s: float) -> tuple[int, int, float, float]:
    """A request's mean TBOT on a co-located A40: decode steps beside ``p`` prefill
    tokens per step of other requests (the emulator's mixed step, averaged)."""
    batch = rand.randint(1, 64)
    ctx = batch * rand.randint(200, 2000)
    p = 0.0 if rand.random() < 0.3 else rand.uniform(10.0, 1500.0)
    tbot = (A40.decode_time_s(batch, ctx) + m1_s * p) * math.exp(rand.gauss(0.0, 0.03))
    return batch, ctx, p, tbot


def test_mixed_step_fit_recovers_decode_and_chunk_coefficients(rand):
    """Request-level TBOTs that include other requests' prefill chunks: with the
    prefill-tokens-per-step feature the fit recovers b0, b1, b2 and the chunk coefficient;
    without it (the old fit) b0..b2 absorb the interference and are biased."""
    m1_true = 1.4 * A40.a1_s  # a1 plus the attention of the chunks that occur
    with_mix, without = FleetCalibration(), FleetCalibration()
    for _ in range(3000):
        batch, ctx, p, tbot = _mixed_tbot(rand, m1_true)
        with_mix.observe_decode("a40", 1, batch, ctx, tbot, prefill_tokens_per_step=p)
        without.observe_decode("a40", 1, batch, ctx, tbot)
    fit = dict(zip(COEF_NAMES, with_mix.model("a40").rls.coef, strict=True))
    assert fit["b0_s"] == pytest.approx(A40.b0_s, rel=0.05)
    assert fit["b1_s"] == pytest.approx(A40.b1_s, rel=0.10)
    assert fit["b2_s"] == pytest.approx(A40.b2_s, rel=0.05)
    assert fit["m1_s"] == pytest.approx(m1_true, rel=0.05)
    old = dict(zip(COEF_NAMES, without.model("a40").rls.coef, strict=True))
    assert old["m1_s"] == pytest.approx(A40.a1_s, rel=1e-9)  # never excited: stays nominal
    assert old["b0_s"] > 1.3 * A40.b0_s  # the interference went into the intercept
    # A decode step with no prefill beside it: the new fit is right, the old one is not.
    truth = A40.decode_time_s(8, 8 * 500)
    assert with_mix.model("a40").decode_step_s(8, 4000) == pytest.approx(truth, rel=0.05)
    assert without.model("a40").decode_step_s(8, 4000) > 1.2 * truth


def test_prefill_tokens_per_step_must_be_non_negative():
    with pytest.raises(ValueError, match="prefill_tokens_per_step"):
        FleetCalibration().observe_decode("a40", 1, 4, 400, 0.02, prefill_tokens_per_step=-1.0)


def test_a_state_without_the_chunk_coefficient_still_loads(rand):
    """A snapshot published before m1 existed: its coefficients load, m1 starts nominal."""
    learned = FleetCalibration()
    feed(learned, rand, 500, {})
    state = learned.snapshot().types["a40"]
    old = msgspec.structs.replace(
        state,
        coef={k: v for k, v in state.coef.items() if k != "m1_s"},
        information=[row[:7] for row in state.information[:7]],
    )
    fresh = FleetCalibration()
    fresh.load(CalibrationSnapshot(types={"a40": old}, transfer=learned.snapshot().transfer))
    coef = dict(zip(COEF_NAMES, fresh.model("a40").rls.coef, strict=True))
    assert coef["b0_s"] == pytest.approx(state.coef["b0_s"], rel=1e-9)
    assert coef["m1_s"] == pytest.approx(A40.a1_s)
