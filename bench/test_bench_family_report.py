"""``bench/family_report.py``: rows from a run's results, the acceptance verdicts, the plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from family_report import MEAN_SEED, headline_rows, load_rows, main, verdicts


def _result(router: str, goodput: float, p99_s: float, hit: float, **extra: object) -> dict:
    shares = extra.pop("shares", {"a": 0.25, "b": 0.25, "c": 0.25, "d": 0.25})
    return {
        "router": router,
        "status": extra.pop("status", "ok"),
        "summary": {
            "slo_attainment": goodput,
            "ttft": {"p50_s": p99_s / 4, "p99_s": p99_s},
            "tbot": {"p99_s": 0.02},
        },
        "engine_share": shares,
        "lp_share": extra.pop("lp", {}),
        "cache_hit_rate": hit,
        "router_cpu_us_per_request": extra.pop("cpu", 100.0),
    }


def _write(run: Path, spec: str, results: list[dict], seed: int = 1) -> None:
    (run / spec).mkdir(parents=True)
    (run / spec / "results.json").write_text(
        json.dumps({"spec": {"seed": seed}, "results": results})
    )


@pytest.fixture
def run(tmp_path: Path) -> Path:
    _write(
        tmp_path,
        "chat-90",
        [
            _result(
                "fastroute",
                0.95,
                0.4,
                0.80,
                cpu=110.0,
                lp={"a": 0.25, "b": 0.25, "c": 0.25, "d": 0.25},
                shares={"a": 0.4, "b": 0.2, "c": 0.2, "d": 0.2},
            ),
            _result("default-4x2", 0.94, 0.5, 0.79),
            _result("fastroute:weighted-hrw", 0.90, 0.6, 0.78, cpu=100.0),
            _result("fastroute:cache-aware", 0.97, 0.3, 0.85),
            _result("cache-aware-4x2", 0.93, 0.5, 0.70),
            _result("fastroute:round-robin", 0.85, 0.9, 0.60),
            _result(
                "sglang:cache_aware",
                0.91,
                0.5,
                0.84,
                shares={"a": 0.5, "b": 0.5, "c": 0.0, "d": 0.0},
            ),
            _result("sglang:round_robin", 0.86, 0.8, 0.60),
            _result("vllm-router:cache_aware", 0.0, 0.0, 0.0, status="failed to start"),
        ],
    )
    _write(tmp_path, "long-tail-70", [_result("fastroute", 0.5, 8.0, 0.0)])
    return tmp_path


def test_the_verdict_compares_the_default_with_the_best_router_peer_and_round_robin(
    run: Path,
) -> None:
    rows = load_rows(run)
    assert {(r.family, r.load) for r in rows} == {("chat", 90), ("long-tail", 70)}
    (chat, tail) = verdicts(rows)
    assert (chat.family, tail.family) == ("chat", "long-tail")
    # the best 1x1 router; the 4x2 variants and a failed router do not count
    assert chat.best.router == "fastroute:cache-aware"
    assert chat.behind_best_points == pytest.approx(2.0)
    assert chat.best_peer is not None and chat.best_peer.router == "sglang:cache_aware"
    assert chat.over_peer_points == pytest.approx(4.0)
    assert chat.round_robin is not None and chat.round_robin.router == "sglang:round_robin"
    assert chat.p99_over_peer == pytest.approx(0.8)
    assert chat.default.served_over_lp == pytest.approx(1.6)
    assert chat.default.share_max_min == pytest.approx(2.0)
    assert tail.best_peer is None and tail.over_peer_points is None


def test_the_report_prints_the_tables_and_draws_the_plot(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # matplotlib is a test dependency (pyproject `test` extra): no skip
    png = run / "families.png"
    assert main([str(run), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "| chat | 90 % | 1 | 0.950 | 0.970 (fastroute:cache-aware) | -2.0 |" in out
    assert "80.0% → 79.0% (-1.0)" in out and "85.0% → 70.0% (-15.0)" in out
    assert "| vllm-router:cache_aware | 90 % | 1 | failed to start |" in out
    assert "| sglang:cache_aware | 90 % | 1 | 0.910 | 125 / 500 | 20.0 | 84.0% | ∞ |" in out
    assert png.stat().st_size > 10_000


def test_a_later_run_replaces_the_routers_it_ran_again(run: Path, tmp_path: Path) -> None:
    rerun = tmp_path / "rerun"
    _write(rerun, "chat-90", [_result("fastroute", 0.99, 0.35, 0.81)])
    rows = {(r.family, r.load, r.router): r for r in load_rows(run, rerun)}
    assert rows[("chat", 90, "fastroute")].goodput == 0.99
    assert rows[("chat", 90, "sglang:cache_aware")].goodput == 0.91
    assert len(rows) == 10


def test_another_seed_is_another_sample_and_the_mean_gets_its_own_verdict(
    run: Path, tmp_path: Path
) -> None:
    second = tmp_path / "seed2"
    _write(
        second,
        "chat-90",
        [_result("fastroute", 0.85, 0.6, 0.70), _result("sglang:cache_aware", 0.93, 0.7, 0.86)],
        seed=2,
    )
    rows = load_rows(run, second)
    by_key = {(r.family, r.load, r.seed, r.router): r for r in rows}
    assert by_key[("chat", 90, 1, "fastroute")].goodput == 0.95
    assert by_key[("chat", 90, 2, "fastroute")].goodput == 0.85
    mean = by_key[("chat", 90, MEAN_SEED, "fastroute")]
    assert mean.goodput == pytest.approx(0.90) and mean.ttft_p99_s == pytest.approx(0.5)
    # only the routers run on both seeds get a mean
    assert ("chat", 90, MEAN_SEED, "fastroute:cache-aware") not in by_key
    verdict = {(v.family, v.seed): v for v in verdicts(rows)}[("chat", MEAN_SEED)]
    assert verdict.best.router == "sglang:cache_aware"
    assert verdict.over_peer_points == pytest.approx(-2.0)
    headline = {(r.family, r.router): r for r in headline_rows(rows)}
    assert headline[("chat", "fastroute")].seed == MEAN_SEED
    assert headline[("chat", "fastroute:cache-aware")].seed == 1


def test_an_empty_run_directory_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main([str(tmp_path)])
