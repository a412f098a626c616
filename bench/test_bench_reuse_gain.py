"""``bench/reuse_gain.py``: its cases, the cached overload variant and the table."""

from __future__ import annotations

import argparse
from pathlib import Path

from reuse_gain import OVERLOAD, cached_overload, cases, table


def test_the_cached_overload_differs_from_the_committed_one_only_in_caching(tmp_path: Path) -> None:
    text = cached_overload(tmp_path).read_text()
    assert "enable_prefix_caching = true" in text and "enable_prefix_caching = false" not in text
    assert text.replace("= true", "= false") == OVERLOAD.read_text().replace("= true", "= false")


def test_every_family_cap_and_seed_is_a_case_and_overload_halves_the_seeds() -> None:
    args = argparse.Namespace(
        families=["rag", "bursts"], policy="prefix-hrw", load=0.9, caps=[1.0, 4.0], seeds=4,
        overload=True, overload_cached="x.toml", decode_cost=4.0,
    )  # fmt: skip
    todo = cases(args)
    assert len(todo) == 2 * 2 * 4 + 2 * 2 * 2
    assert {c["settings"].get("target_load") for c in todo if c["name"] == "rag"} == {0.9}
    assert {c["policy"] for c in todo if c["name"] == "overload, caching off"} == {"weighted-hrw"}


def test_the_table_averages_the_seeds() -> None:
    rows = [
        {"name": "rag", "cap": 4.0, "seed": s, "goodput_rps": g, "unserved": u, "requests": 10,
         "ttft_p99_s": 1.0, "median_gain": 3.0}
        for s, g, u in ((1, 2.0, 1), (2, 4.0, 0))
    ]  # fmt: skip
    assert table(rows, [4.0])[2] == "| rag | 4 | 3.000 | 1 / 20 | 1.00 | 3.00 |"
