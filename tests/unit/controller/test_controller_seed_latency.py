"""The controller's seed latencies come from the hardware datasheets, one entry per GPU."""

from __future__ import annotations

from controller.model import FALLBACK_SEED_LATENCY_S, HARDWARE_SEED_LATENCY_S
from fastroute.hardware import IDLE_LATENCY_S


def test_seed_latencies_are_the_datasheet_figures_of_the_llama_profiles() -> None:
    """Every Llama-3-8B profile (named by its GPU) has its figure; other labels use a40's."""
    assert HARDWARE_SEED_LATENCY_S == {
        "h100": (0.05, 0.008),
        "a100": (0.08, 0.012),
        "a40": (0.15, 0.025),
        "l4": (0.25, 0.045),
    }
    assert HARDWARE_SEED_LATENCY_S == IDLE_LATENCY_S
    assert FALLBACK_SEED_LATENCY_S == (0.15, 0.025)
    assert "a40-qwen2.5-3b" not in HARDWARE_SEED_LATENCY_S
