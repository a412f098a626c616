"""Each engine's share of the controller's LP allocation, from ``GET /v1/plan`` samples."""

from __future__ import annotations

import pytest

from fastroute.fleetbench.lp_share import load_over_share, mean_shares, plan_shares


def _plan(*allocations: dict[str, float]) -> dict[str, object]:
    return {"classes": [{"name": f"c{i}", "allocation_rps": a} for i, a in enumerate(allocations)]}


def test_a_plan_share_sums_the_classes_allocations_per_engine() -> None:
    shares = plan_shares(_plan({"a": 3.0, "b": 1.0}, {"b": 2.0, "c": 2.0}))
    assert shares == pytest.approx({"a": 0.375, "b": 0.375, "c": 0.25})


@pytest.mark.parametrize("plan", [None, [], {"classes": []}, _plan({}), _plan({"a": 0.0})])
def test_no_allocation_is_no_sample(plan: object) -> None:
    assert plan_shares(plan) is None


def test_the_mean_counts_an_engine_missing_from_a_sample_as_zero() -> None:
    mean = mean_shares([{"a": 0.5, "b": 0.5}, {"a": 1.0}])
    assert mean == pytest.approx({"a": 0.75, "b": 0.25})
    assert mean_shares([]) == {}


def test_load_over_share_is_the_largest_ratio_over_planned_engines() -> None:
    served = {"a": 0.5, "b": 0.3, "c": 0.2}
    assert load_over_share(served, {"a": 0.4, "b": 0.4, "c": 0.2}) == pytest.approx(1.25)
    assert load_over_share(served, {"a": 0.0}) is None
    assert load_over_share(served, {}) is None
