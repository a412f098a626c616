"""Prefix-cache hit rates over a window, from each dialect's real exposition text.

The pages are those of ``test_dialects.py`` (``exposition/``); a later scrape is the same page
with the prefix-cache counters moved on, so the parsing is the real dialect's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fastroute.signals.prefix_cache import (
    PrefixHitRate,
    PrefixHitTracker,
    fleet_hit_rate,
)
from fastroute.signals.vllm import EngineSignals, merge_signals, parse_engine_metrics

PAGES = Path(__file__).parent / "exposition"
SGLANG_MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def page(name: str) -> str:
    return (PAGES / name).read_text()


def vllm_page(queries: float, hits: float, generated: float = 51.0) -> str:
    """The real vLLM 0.32 page (737 queried, 128 hit, 51 generated) with the counters set to
    these."""
    text = re.sub(r"(vllm:prefix_cache_queries_total\{[^}]*\}) 737\.0", rf"\1 {queries}", page(
        "vllm_0_32.txt"
    ))  # fmt: skip
    text = re.sub(r"(vllm:generation_tokens_total\{[^}]*\}) 51\.0", rf"\1 {generated}", text)
    return re.sub(r"(vllm:prefix_cache_hits_total\{[^}]*\}) 128\.0", rf"\1 {hits}", text)


def scrape(text: str, kind: str, at_s: float) -> EngineSignals:
    return merge_signals(list(parse_engine_metrics(text, kind, scraped_at_s=at_s).values()))


def test_vllm_window_is_the_difference_of_the_token_counters() -> None:
    t = PrefixHitTracker(window_s=60.0)
    first = t.update(scrape(page("vllm_0_32.txt"), "vllm", 100.0))
    # one scrape: the engine's lifetime, said so (no start)
    assert first.status == "ok" and first.source == "counters" and first.start_s is None
    assert first.rate == pytest.approx(128 / 737) and first.window_s is None
    second = t.update(scrape(vllm_page(1249.0, 512.0), "vllm", 105.0))
    assert (second.hits_tokens, second.queries_tokens) == (384.0, 512.0)
    assert second.rate == pytest.approx(0.75)
    assert (second.start_s, second.end_s, second.window_s) == (100.0, 105.0, 5.0)
    assert not second.reset and second.engines == 1


def test_the_window_counts_the_generated_tokens_too() -> None:
    t = PrefixHitTracker(window_s=60.0)
    assert t.update(scrape(page("vllm_0_32.txt"), "vllm", 100.0)).generated_tokens == 51.0
    r = t.update(scrape(vllm_page(1249.0, 512.0, generated=251.0), "vllm", 105.0))
    assert (r.queries_tokens, r.hits_tokens, r.generated_tokens) == (512.0, 384.0, 200.0)
    no_counter = re.sub(r"vllm:generation_tokens_total\{[^}]*\} 51\.0\n", "", page("vllm_0_32.txt"))
    assert PrefixHitTracker().update(scrape(no_counter, "vllm", 1.0)).generated_tokens is None
    # a generation counter going backwards is a restart like the prefix counters'
    back = t.update(scrape(vllm_page(1300.0, 520.0, generated=10.0), "vllm", 108.0))
    assert back.reset and back.generated_tokens == 10.0
    lama = PrefixHitTracker().update(scrape(page("llamacpp.txt"), "llamacpp", 1.0))
    assert lama.status == "unknown" and lama.generated_tokens is None  # no prefix counters


def test_no_new_queries_is_no_traffic_not_zero() -> None:
    t = PrefixHitTracker()
    t.update(scrape(page("vllm_0_32.txt"), "vllm", 100.0))
    idle = t.update(scrape(page("vllm_0_32.txt"), "vllm", 102.0))
    assert idle.status == "no_traffic" and idle.rate is None
    assert idle.queries_tokens == 0.0 and idle.source == "counters"
    fresh = PrefixHitTracker().update(scrape(vllm_page(0.0, 0.0), "vllm", 1.0))
    assert fresh.status == "no_traffic" and fresh.rate is None


def test_counters_going_backwards_are_a_restart_counted_from_zero() -> None:
    t = PrefixHitTracker(window_s=60.0)
    t.update(scrape(vllm_page(5000.0, 4000.0), "vllm", 100.0))
    after = t.update(scrape(vllm_page(256.0, 128.0), "vllm", 103.0))
    # what the restarted engine counted is the window's (it restarted after t=100)
    assert after.reset and after.rate == pytest.approx(0.5)
    assert (after.hits_tokens, after.queries_tokens, after.start_s) == (128.0, 256.0, 100.0)
    later = t.update(scrape(vllm_page(512.0, 384.0), "vllm", 106.0))
    assert later.reset and later.rate == pytest.approx(384 / 512)  # the restart is in the window
    gone = t.update(scrape(vllm_page(1024.0, 640.0), "vllm", 170.0))
    # the base moved past the restart: a plain window again
    assert not gone.reset and gone.start_s == 106.0
    assert gone.rate == pytest.approx((640 - 384) / (1024 - 512))


def test_window_rolls_keeping_one_base_before_it() -> None:
    t = PrefixHitTracker(window_s=10.0)
    for i, at in enumerate((0.0, 4.0, 8.0, 12.0, 16.0)):
        r = t.update(scrape(vllm_page(100.0 * (i + 1), 10.0 * (i + 1) * i), "vllm", at))
    # the newest scrape at or before 16 - 10 = 6 is the one at 4: the window is 4..16
    assert (r.start_s, r.end_s) == (4.0, 16.0)
    assert r.queries_tokens == 500.0 - 200.0 and r.hits_tokens == 10.0 * 5 * 4 - 10.0 * 2 * 1


def test_sglang_counters_win_over_its_gauge() -> None:
    text = page("sglang.txt")
    r = PrefixHitTracker().update(scrape(text, "sglang", 10.0))
    assert r.source == "counters" and r.rate == pytest.approx(61024.0 / 8.128902e6)
    later = text.replace("8.128902e+06", "8.130902e+06").replace("61024.0", "62024.0")
    t = PrefixHitTracker()
    t.update(scrape(text, "sglang", 10.0))
    assert t.update(scrape(later, "sglang", 20.0)).rate == pytest.approx(1000 / 2000)


def test_a_rate_gauge_without_counters_is_taken_as_is() -> None:
    """SGLang's page without its token counters: ``sglang:cache_hit_rate`` as the engine says."""
    text = "\n".join(
        line
        for line in page("sglang.txt").splitlines()
        if not line.startswith(("sglang:prompt_tokens_total", "sglang:cached_tokens_total"))
    )
    r = PrefixHitTracker().update(scrape(text, "sglang", 10.0))
    assert r.status == "ok" and r.source == "gauge"
    assert r.rate == pytest.approx(0.007507552643049313)
    assert r.queries_tokens is None and r.start_s is None and r.end_s == 10.0


@pytest.mark.parametrize(
    ("name", "kind"), [("llamacpp.txt", "llamacpp"), ("sglang_legacy.txt", "sglang")]
)
def test_absent_is_unknown_never_zero(name: str, kind: str) -> None:
    r = PrefixHitTracker().update(scrape(page(name), kind, 10.0))
    assert r.status == "unknown" and r.rate is None and r.source is None
    assert PrefixHitTracker().current.status == "unknown"


def test_fleet_rate_is_token_weighted_over_the_engines_with_counters() -> None:
    a, b = PrefixHitTracker(window_s=5.0), PrefixHitTracker()
    a.update(scrape(vllm_page(0.0, 0.0), "vllm", 100.0))
    b.update(scrape(vllm_page(0.0, 0.0), "vllm", 101.0))
    ra = a.update(scrape(vllm_page(1000.0, 900.0), "vllm", 110.0))  # 90 %, 1000 tokens
    rb = b.update(scrape(vllm_page(100.0, 0.0), "vllm", 111.0))  # 0 %, 100 tokens
    gauge = PrefixHitRate(status="ok", rate=0.99, source="gauge", engines=1)
    fleet = fleet_hit_rate([ra, rb, gauge, PrefixHitTracker().current])
    assert fleet.rate == pytest.approx(900 / 1100)  # not the mean of 0.9 and 0
    assert fleet.engines == 2 and (fleet.start_s, fleet.end_s) == (100.0, 111.0)
    assert fleet.generated_tokens == 0.0  # both windows counted their (unchanged) 51
    assert fleet_hit_rate([gauge]).status == "unknown"
    idle = a.update(scrape(vllm_page(1000.0, 900.0), "vllm", 120.0))  # base: t=110
    assert idle.status == "no_traffic"
    assert fleet_hit_rate([idle]).status == "no_traffic"
    assert fleet_hit_rate([]).status == "unknown"


def test_json_says_the_window() -> None:
    t = PrefixHitTracker()
    t.update(scrape(page("vllm_0_32.txt"), "vllm", 100.0))
    d = t.update(scrape(vllm_page(1249.0, 512.0), "vllm", 130.0)).as_json()
    assert d["window_s"] == 30.0 and d["status"] == "ok" and d["rate"] == pytest.approx(0.75)
    with pytest.raises(ValueError, match="window_s"):
        PrefixHitTracker(window_s=0.0)
