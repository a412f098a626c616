"""The controller's tenant board: demand from reports, shares and shed fractions in meta."""

from __future__ import annotations

import pytest

from controller.tenant_demand import STALE_AFTER_PERIODS, TenantBoard
from fastroute.config import decode_config
from fastroute.signals.reports import REPORT_VERSION, Report, TenantDemand

CONFIG = """
[[engines]]
name = "e0"
url = "http://127.0.0.1:9"
models = ["m"]

[[tenants]]
name = "a"
api_keys = ["ka"]
requests_per_min = 600
max_concurrent = 10
weight = 2

[[tenants]]
name = "b"
api_keys = ["kb"]
"""


def _report(proxy: str, *demands: TenantDemand) -> Report:
    return Report(
        REPORT_VERSION,
        "local",
        proxy + ":1",
        0.0,
        1.0,
        [],
        [],
        proxy_id=proxy,
        tenants=list(demands),
    )


@pytest.fixture
def board() -> TenantBoard:
    return TenantBoard(decode_config(CONFIG, source="t.toml"), period_s=1.0)


def test_limits_follow_the_demand_split(board: TenantBoard) -> None:
    # 16 + 4 req/s = 960 + 240 req/min against 600: the small proxy keeps its 240.
    board.observe(_report("p1", TenantDemand("a", "default", 16, 1600)))
    board.observe(_report("p2", TenantDemand("a", "default", 4, 400)))
    board.close_period()
    limits = board.meta({"default": 0.0})["tenant_limits"]
    assert limits["p1"]["a"][0] == pytest.approx(360)
    assert limits["p2"]["a"][0] == pytest.approx(240)
    assert limits["p1"]["a"][1] is None  # no token limit
    assert limits["p1"]["a"][2] + limits["p2"]["a"][2] in (10, 11)  # rounding, >= 1 each
    assert "b" not in limits["p1"]  # unlimited tenants are not published


def test_a_silent_proxy_is_dropped(board: TenantBoard) -> None:
    board.observe(_report("p1", TenantDemand("a", "default", 5, 0)))
    board.observe(_report("p2", TenantDemand("a", "default", 5, 0)))
    board.close_period()
    for _ in range(STALE_AFTER_PERIODS + 1):
        board.observe(_report("p1", TenantDemand("a", "default", 5, 0)))
        board.close_period()
    limits = board.meta({})["tenant_limits"]
    assert set(limits) == {"p1"}
    assert limits["p1"]["a"][0] == pytest.approx(600)


def test_a_shed_priority_is_shared_by_weight(board: TenantBoard) -> None:
    board.observe(
        _report("p1", TenantDemand("a", "default", 10, 0), TenantDemand("b", "default", 10, 0))
    )
    board.close_period()
    # Half the priority is shed: 10 req/s admitted of 20, split 2:1 by weight.
    shed = board.meta({"default": 0.5})["tenant_shed"]
    assert 1 - shed["a"] == pytest.approx(2 * (1 - shed["b"]), rel=1e-3)
    rows = {r["tenant"]: r for r in board.plan_json()}
    assert rows["a"]["admitted_rps"] == pytest.approx(10 * 2 / 3, rel=1e-3)
    assert rows["b"]["shed_rps"] == pytest.approx(10 - 10 / 3, rel=1e-3)
    assert board.meta({"default": 0.0}).get("tenant_shed") is None  # no shed, no entry


def test_unknown_tenants_and_old_reports_are_ignored(board: TenantBoard) -> None:
    board.observe(_report("p1", TenantDemand("zzz", "default", 10, 0)))
    board.observe(Report(REPORT_VERSION, "local", "w", 0.0, 1.0, [], []))
    board.close_period()
    assert board.meta({}) == {"tenant_limits": {"p1": {"a": [600.0, None, 10]}}}
