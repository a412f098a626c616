"""Hardware datasheets: coefficients follow from the published figures they are derived from."""

from __future__ import annotations

import pytest

from fastroute.hardware import (
    BLOCK_SIZE_TOKENS,
    GPUS,
    IDLE_LATENCY_S,
    LLAMA_3_8B,
    MEM_EFFICIENCY,
    PROFILES,
    STEP_OVERHEAD_S,
    derive_profile,
    get_profile,
    seed_latency_s,
)


def test_llama3_8b_kv_bytes_per_token_is_128_kib():
    """2 (K,V) x 32 layers x 8 KV heads x 128 head_dim x 2 bytes = 128 KiB."""
    assert LLAMA_3_8B.kv_bytes_per_token == 128 * 1024


def test_required_profiles_exist():
    """h100, a100, a40 and l4 are built in and resolvable case-insensitively."""
    assert {"h100", "a100", "a40", "l4"} <= set(PROFILES)
    assert get_profile("A40") is PROFILES["a40"]


def test_unknown_profile_names_the_choices():
    """An unknown profile name raises KeyError listing the valid ones."""
    with pytest.raises(KeyError, match="a40"):
        get_profile("tpu")


@pytest.mark.parametrize("name", sorted(GPUS))
def test_decode_base_is_weight_streaming_time(name):
    """b0 = weight bytes / (bandwidth x efficiency) + step overhead."""
    gpu = GPUS[name]
    prof = PROFILES[name]
    expected = LLAMA_3_8B.weight_bytes / (gpu.bandwidth_Bps * MEM_EFFICIENCY) + STEP_OVERHEAD_S
    assert prof.b0_s == pytest.approx(expected)
    assert prof.b2_s == pytest.approx(
        LLAMA_3_8B.kv_bytes_per_token / (gpu.bandwidth_Bps * MEM_EFFICIENCY)
    )
    assert prof.a3_s == pytest.approx(2 * prof.a2_s)  # causal mask halves a2 only


def test_faster_gpus_have_smaller_coefficients():
    """Ordering by datasheet: h100 < a100 < a40 < l4 for weight streaming."""
    b0 = [PROFILES[n].b0_s for n in ("h100", "a100", "a40", "l4")]
    assert b0 == sorted(b0)
    assert PROFILES["h100"].a1_s < PROFILES["a100"].a1_s < PROFILES["a40"].a1_s


def test_kv_capacity_is_whole_blocks_and_ordered_by_memory():
    """Capacity is a multiple of 16 tokens; 80 GB parts hold more than 48 GB, more than 24 GB."""
    for prof in PROFILES.values():
        assert prof.kv_capacity_tokens % BLOCK_SIZE_TOKENS == 0
        assert prof.num_blocks * BLOCK_SIZE_TOKENS == prof.kv_capacity_tokens
    assert PROFILES["h100"].kv_capacity_tokens > PROFILES["a40"].kv_capacity_tokens
    assert PROFILES["a40"].kv_capacity_tokens > PROFILES["l4"].kv_capacity_tokens > 0


def test_model_that_does_not_fit_is_rejected():
    """A GPU smaller than the weights cannot host the model."""
    tiny = GPUS["l4"].__class__("tiny", "8 GB", 8 * 1024**3, 1e11, 1e13, 2048)
    with pytest.raises(ValueError, match="does not fit"):
        derive_profile(tiny)


def test_step_time_helpers_match_formula():
    """prefill_time_s and decode_time_s evaluate the documented polynomials."""
    p = PROFILES["a40"]
    assert p.prefill_time_s(100, 50) == pytest.approx(
        p.a0_s + p.a1_s * 100 + p.a2_s * 100**2 + p.a3_s * 100 * 50
    )
    assert p.decode_time_s(8, 4000) == pytest.approx(p.b0_s + 8 * p.b1_s + 4000 * p.b2_s)


def test_qwen_profile_is_derived_like_the_builtins():
    """Same GPU, smaller model: same fixed overhead shape, cheaper per token, more KV room."""
    q, llama = get_profile("a40-qwen2.5-3b"), PROFILES["a40"]
    assert q.name == "a40-qwen2.5-3b" and get_profile("A40") is llama
    assert q.a1_s < llama.a1_s and q.b0_s < llama.b0_s
    assert q.kv_capacity_tokens > llama.kv_capacity_tokens


def test_seed_latency_is_stated_per_gpu_for_llama_3_8b_only():
    """The idle figures belong to the GPU of a Llama-3-8B profile, case-insensitively; other
    models and unknown labels have none (their users choose a fallback)."""
    assert seed_latency_s("h100") == (0.05, 0.008)
    assert seed_latency_s("L4") == IDLE_LATENCY_S["l4"] == (0.25, 0.045)
    assert [seed_latency_s(g) for g in GPUS] == [IDLE_LATENCY_S[g] for g in GPUS]
    assert seed_latency_s("a40-qwen2.5-3b") is None
    assert seed_latency_s("h100-sxm") is None
    # Ordered by memory bandwidth: a faster GPU answers and decodes sooner.
    by_bandwidth = sorted(GPUS, key=lambda g: -GPUS[g].bandwidth_Bps)
    assert [IDLE_LATENCY_S[g] for g in by_bandwidth] == sorted(IDLE_LATENCY_S.values())
