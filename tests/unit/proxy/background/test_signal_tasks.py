"""The engine state a worker reports: its own in-flight share, not the host's count."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from fastroute.config import decode_config
from fastroute.hashing import engine_id
from fastroute.proxy.background.scraper import EngineScraper
from fastroute.proxy.background.signal_tasks import SignalTasks, _engine_state, _SignalCollector
from fastroute.proxy.proxy_app import build_context
from fastroute.signals.vllm import EngineSignals
from fastroute.tables.stats import Counter, StatsBlock

_CONFIG = """
[[engines]]
name = "e0"
url = "http://127.0.0.1:9"
models = ["m"]
[[engines]]
name = "e1"
url = "http://127.0.0.1:10"
models = ["m"]
"""


def test_report_carries_this_workers_in_flight_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another worker's 5 requests to e0 are in the shared block (routing sees them),
    but this worker's report counts only its own 1: the controller sums the reports."""
    monkeypatch.setenv("FASTROUTE_SHM_DIR", str(tmp_path))
    config = decode_config(_CONFIG, source="t.toml")
    block = StatsBlock.create("report-share", [engine_id("e0"), engine_id("e1")])
    try:
        ctx = build_context(config, block, None)
        block.add(0, Counter.IN_FLIGHT, 5)  # another worker of this host
        ctx.fleet.attempt_started(0)
        assert list(ctx.fleet.in_flight) == [6, 0]  # what routing balances on
        in_flight, ejected = _engine_state(ctx)
        assert in_flight == {engine_id("e0"): 1, engine_id("e1"): 0}
        assert ejected == {engine_id("e0"): False, engine_id("e1"): False}
        ctx.fleet.attempt_finished(0)
        assert _engine_state(ctx)[0][engine_id("e0")] == 0
    finally:
        block.unlink()


def _exposition(tasks: SignalTasks) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(_SignalCollector(tasks))
    text = generate_latest(registry).decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_metrics_show_each_engines_prefix_hit_ratio_and_the_fleets() -> None:
    """From the engines' own token counters over the window: e0 75 % of 512 tokens, e1 0 %
    of 100 (the fleet is token-weighted, not the mean); e2 has no prefix-cache metric: no
    ratio (unknown is never 0); a stale engine is left off."""
    config = decode_config(
        _CONFIG + '[[engines]]\nname = "e2"\nurl = "http://127.0.0.1:11"\nmodels = ["m"]\n'
        '[[engines]]\nname = "e3"\nurl = "http://127.0.0.1:12"\nmodels = ["m"]\n'
    )
    scraper = EngineScraper(config.engines, interval_s=1.0)
    now = time.time()
    r = scraper.results
    for at, counters in ((now - 2.0, (100.0, 0.0, 0.0, 0.0)), (now, (612.0, 384.0, 100.0, 0.0))):
        q0, h0, q1, h1 = counters
        r["e0"].absorb({"m": EngineSignals(
            prefix_cache_queries_total=q0, prefix_cache_hits_total=h0, scraped_at_s=at
        )})  # fmt: skip
        r["e1"].absorb({"m": EngineSignals(
            prefix_cache_queries_total=q1, prefix_cache_hits_total=h1, scraped_at_s=at
        )})  # fmt: skip
        r["e3"].absorb({"m": EngineSignals(
            prefix_cache_queries_total=q0, prefix_cache_hits_total=h0, scraped_at_s=at - 60.0
        )})  # fmt: skip
    r["e2"].absorb({"m": EngineSignals(num_requests_running=0.0, scraped_at_s=now)})
    m = _exposition(SignalTasks(scraper=scraper))
    ratio = "fastroute_proxy_engine_prefix_cache_hit_ratio"
    assert m[f'{ratio}{{engine="e0"}}'] == pytest.approx(0.75)
    assert m[f'{ratio}{{engine="e1"}}'] == 0.0
    assert f'{ratio}{{engine="e2"}}' not in m and f'{ratio}{{engine="e3"}}' not in m
    assert m['fastroute_proxy_engine_prefix_cache_queried_tokens{engine="e0"}'] == 512.0
    assert m['fastroute_proxy_engine_prefix_cache_window_seconds{engine="e0"}'] == 2.0
    assert m["fastroute_proxy_prefix_cache_hit_ratio"] == pytest.approx(384 / 612)
    # no traffic in the window: no ratio (a queried count of 0 says why), no fleet figure
    for name in ("e0", "e1"):
        sig = r[name].signals
        assert sig is not None
        r[name].absorb({"m": msgspec.structs.replace(sig, scraped_at_s=now + 120.0)})
        r[name].absorb({"m": msgspec.structs.replace(sig, scraped_at_s=now + 121.0)})
    m = _exposition(SignalTasks(scraper=scraper))
    assert not any(k.startswith(ratio) for k in m), m
    assert "fastroute_proxy_prefix_cache_hit_ratio" not in m
