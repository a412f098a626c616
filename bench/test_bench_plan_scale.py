"""Smoke of the plan-at-scale benchmark (bench/bench_plan_scale.py) at a tiny size.

The figures come from the script (docs/controller.md, "Plan at scale"); this proves its periods
still run and that a region's own table is the block of the dense rows.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from bench_plan_scale import RunSpec, periods


@pytest.mark.benchmark(group="plan-scale")
def test_plan_scale_tiny_periods(benchmark) -> None:
    """Cold + one warm period at 4 regions × 120 engines × 3 classes per region."""
    spec = RunSpec(4, 120, 3, warm_periods=1)
    fleet, lp, ps = benchmark.pedantic(lambda: periods(spec), rounds=3, iterations=1)
    assert [p["status"] for p in ps] == ["Optimal", "Optimal"]
    assert ps[1]["warm"] and ps[1]["n_groups"] == 12
    # home region + 3 nearest of 4: every engine is eligible, so the two region tables agree
    assert ps[1]["table_eligible_cols_bytes_per_region"] == ps[1]["table_bytes_per_region"]
    benchmark.extra_info.update(warm_plan_s=ps[1]["plan_region_direct_s"])


def test_plan_scale_region_table_is_smaller_than_all_engines() -> None:
    """With residency to 4 of 12 regions a region's table covers a third of the engines."""
    _, _, ps = periods(RunSpec(12, 360, 2, warm_periods=1))
    p = ps[1]
    assert p["table_eligible_cols_bytes_per_region"] < 0.5 * p["table_bytes_per_region"]


def test_plan_scale_fanout_region_blocks_are_smaller_than_the_full_table() -> None:
    """The fan-out figures: a region's block (its 1/12 of the rows, over the engines they weight)
    is below a twelfth of the full table in both encodings, and within the block over its
    eligible engines (weighted engines are eligible ones; no flags here; + the 20-byte meta)."""
    _, _, ps = periods(RunSpec(12, 360, 2, warm_periods=1))
    p = ps[1]
    for fmt in ("msgpack", "json"):
        full = p[f"fanout_full_{fmt}_bytes"]
        assert p[f"fanout_region_{fmt}_bytes_max"] < full / 12
        assert p[f"fanout_region_{fmt}_bytes_all"] < full
        assert p[f"fanout_regions_{fmt}_s"] > 0
    assert p["fanout_region_msgpack_bytes_max"] <= p["table_eligible_cols_bytes_per_region"] + 64


def test_plan_scale_models_structure_aggregates_models_sharing_engines() -> None:
    """cluster × model × priority classes: models of one engine set aggregate (per region
    sets × priorities LP classes, or sets alone across priorities); without shared sets only
    the priorities aggregate."""
    spec = RunSpec(4, 240, 18, warm_periods=1, structure="models", n_models=6, n_priorities=3,
                   engine_sets=3)  # fmt: skip
    fleet, lp, ps = periods(spec)
    assert [p["status"] for p in ps] == ["Optimal", "Optimal"] and ps[1]["warm"]
    assert lp.classes.n_classes == 4 * 18 and lp.classes.n_groups == 4 * 3
    _, by_priority, _ = periods(replace(spec, across_priorities=False))
    assert by_priority.classes.n_groups == 4 * 3 * 3
    alone = replace(spec, classes_per_region=9, n_models=3, across_priorities=False)
    _, lp_alone, _ = periods(alone)
    assert lp_alone.classes.n_groups == lp_alone.classes.n_classes == 4 * 9
    _, lp_alone, _ = periods(replace(alone, across_priorities=True))
    assert lp_alone.classes.n_groups == 4 * 3
