"""Parsing one engine's ``/metrics`` page: the plain-text reader vs prometheus_client.

The controller parses every engine's page at every scrape
(``fastroute.signals.vllm.parse_vllm_metrics``). ``plain`` is the default path (the page is
plain text, read by ``fastroute.signals.exposition.plain_samples``); ``full`` forces
``prometheus_client``'s parser on the same page, as before that reader existed. Compare
the two medians of one run: ``.venv/bin/pytest bench/test_bench_exposition.py``.
"""

from __future__ import annotations

import pytest

from fastroute.emulator.faults import FaultController
from fastroute.emulator.metrics import EngineMetrics
from fastroute.emulator.model import EngineConfig, EngineModel
from fastroute.hardware import get_profile
from fastroute.signals import vllm


def _page() -> str:
    """An emulated A40's page with both metric generations and some observations."""
    model = EngineModel(get_profile("a40"), EngineConfig(), seed=0)
    metrics = EngineMetrics("demo-8b", model, FaultController("e0"), compat="both")
    for v in (0.05, 0.3, 0.3, 7.0):
        metrics.ttft.observe(v)
    metrics.itl.observe(0.02)
    metrics.e2e.observe(1.2)
    return metrics.render().decode()


@pytest.mark.parametrize("path", ["plain", "full"])
def test_parse_engine_page(benchmark, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    text = _page()
    expected = vllm.parse_vllm_metrics(text, scraped_at_s=1.0)
    if path == "full":
        monkeypatch.setattr(vllm, "plain_samples", lambda text, prefix: None)
    result = benchmark(vllm.parse_vllm_metrics, text, scraped_at_s=1.0)
    assert repr(result) == repr(expected)  # both paths read the page alike
