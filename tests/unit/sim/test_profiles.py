"""Simulated hardware profiles: the Qwen2.5-3B/A40 profile and true-vs-datasheet factors."""

from __future__ import annotations

import pytest

from fastroute.emulator.profiles import PROFILES
from fastroute.sim.profiles import nominal_step_times, sim_profile, true_profile


def test_qwen_profile_is_derived_like_the_builtins():
    """Same GPU, smaller model: same fixed overhead shape, cheaper per token, more KV room."""
    q, llama = sim_profile("a40-qwen2.5-3b"), PROFILES["a40"]
    assert q.name == "a40-qwen2.5-3b" and sim_profile("A40") is llama
    assert q.a1_s < llama.a1_s and q.b0_s < llama.b0_s
    assert q.kv_capacity_tokens > llama.kv_capacity_tokens
    with pytest.raises(KeyError, match="choose one of"):
        sim_profile("tpu")


def test_true_profile_scales_only_the_named_coefficients():
    """Factors multiply the true step times; the nominal constants stay the datasheet's."""
    q = sim_profile("a40-qwen2.5-3b")
    t = true_profile(q, {"b0_s": 1.5, "a1_s": 0.8})
    assert t.b0_s == pytest.approx(1.5 * q.b0_s) and t.a1_s == pytest.approx(0.8 * q.a1_s)
    assert t.a0_s == q.a0_s and t.name == q.name
    assert true_profile(q, {}) is q
    assert nominal_step_times(q).b0_s == q.b0_s
    with pytest.raises(ValueError, match="unknown step-time coefficient"):
        true_profile(q, {"c0_s": 2.0})
    with pytest.raises(ValueError, match="must be a finite number > 0"):
        true_profile(q, {"a0_s": 0.0})
