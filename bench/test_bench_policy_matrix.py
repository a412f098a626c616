"""``bench/policy_matrix.py``: the first router against the best of the others."""

from __future__ import annotations

import math

from policy_matrix import versus_table


def _run(policy: str, family: str, goodput: float, p99: float, seed: int = 1, workers: int = 1):
    return {
        "family": family, "load": 0.9, "seed": seed, "workers": workers, "proxies": 1,
        "policy": policy, "goodput_rps": goodput, "ttft_p99_s": p99,
    }  # fmt: skip


def _body(table: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]


def test_each_cell_is_judged_against_its_own_best_other_router() -> None:
    results = [
        _run("a", "chat", 10.0, 0.5), _run("b", "chat", 8.0, 1.0), _run("c", "chat", 5.0, 0.25),
        _run("a", "rag", 9.0, 3.0), _run("b", "rag", 10.0, 1.0), _run("c", "rag", 1.0, 4.0),
    ]  # fmt: skip
    [row] = _body(versus_table(results, "a"))
    assert row[:2] == ["1×1", "2"]
    assert float(row[2]) == round(math.sqrt(10 / 8 * 9 / 10), 3)  # geometric mean of 1.25, 0.9
    assert row[3] == "0.900 (rag 0.9)"
    assert row[4] == "1 (1)"  # best in chat; rag is 10 % behind
    assert float(row[5]) == round(math.sqrt(0.5 / 0.25 * 3.0 / 1.0), 2)
    assert row[6] == "3.00 (rag 0.9)"


def test_seeds_are_averaged_and_shapes_kept_apart() -> None:
    results = [
        _run("a", "chat", 9.0, 1.0, seed=1), _run("a", "chat", 11.0, 1.0, seed=2),
        _run("b", "chat", 10.0, 1.0, seed=1), _run("b", "chat", 10.0, 1.0, seed=2),
        _run("a", "chat", 5.0, 1.0, workers=4), _run("b", "chat", 10.0, 1.0, workers=4),
    ]  # fmt: skip
    one, four = _body(versus_table(results, "a"))
    assert one[0] == "1×1" and one[2] == "1.000" and one[4] == "1 (1)"
    assert four[0] == "4×1" and four[3] == "0.500 (chat 0.9)" and four[4] == "0 (0)"


def test_cells_without_the_subject_or_a_rival_are_left_out() -> None:
    results = [_run("a", "chat", 1.0, 1.0), _run("b", "rag", 1.0, 1.0)]
    assert _body(versus_table(results, "a")) == []
    served_nothing = [_run("a", "chat", 0.0, math.nan), _run("b", "chat", 0.0, math.nan)]
    [row] = _body(versus_table(served_nothing, "a"))
    assert row[2] == "1.000" and row[5:] == ["–", "–"]


def test_a_subject_that_served_nothing_has_a_zero_geometric_mean() -> None:
    results = [_run("a", "chat", 0.0, math.nan), _run("b", "chat", 4.0, 1.0),
               _run("a", "rag", 5.0, 1.0), _run("b", "rag", 5.0, 1.0)]  # fmt: skip
    [row] = _body(versus_table(results, "a"))
    assert row[2] == "0.000" and row[3] == "0.000 (chat 0.9)" and row[4] == "1 (1)"
    assert row[5:] == ["1.00", "1.00 (rag 0.9)"]  # no p99 where nothing was served
