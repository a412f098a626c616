"""True step times on an emulated engine: ``EngineSpec.step_time_factors`` and the CLI flag."""

from __future__ import annotations

import argparse

import pytest

from fastroute.emulator import cli
from fastroute.emulator.profiles import STEP_TIME_COEFFICIENTS, true_profile
from fastroute.emulator.server import EmulatedEngine, EngineSpec
from fastroute.hardware import PROFILES, get_profile
from fastroute.predict import NominalStepTimes

FACTORS = {"a0_s": 1.5, "a1_s": 0.8, "b2_s": 1.3}


def test_the_engine_runs_the_scaled_profile_under_the_datasheet_name() -> None:
    datasheet = PROFILES["a40-qwen2.5-3b"]
    engine = EmulatedEngine(EngineSpec(profile="a40-qwen2.5-3b", step_time_factors=FACTORS))
    assert engine.profile.name == "a40-qwen2.5-3b"
    assert engine.model.profile is engine.profile  # the step loop's model runs it
    for key in STEP_TIME_COEFFICIENTS:
        want = getattr(datasheet, key) * FACTORS.get(key, 1.0)
        assert getattr(engine.profile, key) == pytest.approx(want, rel=1e-12), key
    assert engine.profile.kv_capacity_tokens == datasheet.kv_capacity_tokens
    assert engine.metrics.info["step_time_factors"] == "a0_s=1.5,a1_s=0.8,b2_s=1.3"
    plain = EmulatedEngine(EngineSpec(profile="a40-qwen2.5-3b"))
    assert plain.profile == datasheet and plain.metrics.info["step_time_factors"] == ""


def test_a_bad_factor_fails_at_construction() -> None:
    with pytest.raises(ValueError, match="unknown step-time coefficient 'c0_s'"):
        EmulatedEngine(EngineSpec(step_time_factors={"c0_s": 2.0}))


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_cli_flag_parses_repeated_factors() -> None:
    args = _args("--profile", "a40-qwen2.5-3b", "--step-time-factor", "b0_s=1.5",
                 "--step-time-factor", " a2_s = 2 ")  # fmt: skip
    specs = cli._specs(args)
    assert dict(specs[0].step_time_factors) == {"b0_s": 1.5, "a2_s": 2.0}
    assert specs[0].profile == "a40-qwen2.5-3b"


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("b0_s", "expected COEF=FACTOR"),
        ("=2", "expected COEF=FACTOR"),
        ("b0_s=fast", "could not convert"),
        ("b0_s=0", "must be a finite number > 0"),
        ("b0_s=inf", "must be a finite number"),
        ("z9=1.5", "unknown step-time coefficient 'z9'"),
    ],
)
def test_cli_rejects_bad_factors_with_exit_2(
    item: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.run(_args("--step-time-factor", item)) == 2
    assert message in capsys.readouterr().err


def test_cli_rejects_a_repeated_coefficient(capsys: pytest.CaptureFixture[str]) -> None:
    args = _args("--step-time-factor", "b0_s=1.5", "--step-time-factor", "b0_s=2")
    assert cli.run(args) == 2
    assert "b0_s given twice" in capsys.readouterr().err


def test_true_profile_scales_only_the_named_coefficients():
    """Factors multiply the true step times; the nominal constants stay the datasheet's."""
    q = get_profile("a40-qwen2.5-3b")
    t = true_profile(q, {"b0_s": 1.5, "a1_s": 0.8})
    assert t.b0_s == pytest.approx(1.5 * q.b0_s) and t.a1_s == pytest.approx(0.8 * q.a1_s)
    assert t.a0_s == q.a0_s and t.name == q.name
    assert true_profile(q, {}) is q
    assert NominalStepTimes.from_profile(q).b0_s == q.b0_s
    with pytest.raises(ValueError, match="unknown step-time coefficient"):
        true_profile(q, {"c0_s": 2.0})
    with pytest.raises(ValueError, match="must be a finite number > 0"):
        true_profile(q, {"a0_s": 0.0})
