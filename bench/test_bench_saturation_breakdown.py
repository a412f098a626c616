"""``bench/saturation_breakdown.py``: the per-record breakdown and one short run."""

from __future__ import annotations

from saturation_breakdown import breakdown, main

from fastroute.sim.metrics import Slo
from fastroute.sim.records import RequestRecord


def _record(engine: str, arrival_s: float, ttft_s: float, tbot_s: float, **kw) -> RequestRecord:
    first = arrival_s + ttft_s
    return RequestRecord(
        request_id=f"{engine}-{arrival_s}", arrival_s=arrival_s, first_token_s=first,
        finish_s=first + tbot_s * 10, output_tokens=11, engine=engine, **kw,
    )  # fmt: skip


def test_misses_prefill_and_decode_batch_per_engine() -> None:
    records = [
        _record("a", 0.0, 5.0, 0.5, prompt_tokens=1000, cached_tokens=900),  # warm-up
        _record("a", 10.0, 0.1, 0.05, prompt_tokens=1000, cached_tokens=900),  # met
        _record("a", 11.0, 3.0, 0.05, prompt_tokens=500, cached_tokens=-1),  # TTFT
        _record("b", 12.0, 0.1, 0.2, prompt_tokens=200, cached_tokens=0),  # TBOT
        _record("b", 13.0, 3.0, 0.2, prompt_tokens=100, cached_tokens=50),  # both
        RequestRecord(request_id="shed", arrival_s=14.0, outcome="shed", engine="b"),
    ]
    out = breakdown(records, Slo(ttft_s=2.0, tbot_s=0.1), warmup_s=10.0, window_s=10.0)
    assert out["misses"] == {"met": 1, "ttft": 1, "tbot": 1, "both": 1}
    assert out["prefilled_tokens"] == 100 + 500 + 200 + 50
    assert out["engines"]["a"] == {"served": 2, "tbot_misses": 0, "decode_batch": 0.1}
    assert out["engines"]["b"] == {"served": 2, "tbot_misses": 2, "decode_batch": 0.4}


def test_a_short_run_prints_every_engine(capsys) -> None:
    assert main(["--family", "hot-prompt", "--load", "0.5", "--routers", "round-robin",
                 "--seeds", "1", "--set", "duration_s=10", "--set", "warmup_s=2",
                 "--set", "drain_s=10"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "round-robin seed 1: misses" in out and out.count("decode batch") == 4
