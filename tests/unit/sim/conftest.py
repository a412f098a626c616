"""Small scenarios for the simulator tests (seconds of virtual time, a few engines)."""

from __future__ import annotations

from typing import Any

import pytest

from fastroute.sim.scenario import Scenario, scenario_from_dict


def small(**overrides: Any) -> Scenario:
    """Two regions, four H100s, light multi-turn chat for 40 s."""
    data: dict[str, Any] = {
        "name": "small",
        "duration_s": 40.0,
        "drain_s": 60.0,
        "regions": [{"name": "eu"}, {"name": "us"}],
        "network": {"intra_region_ms": 1.0, "inter_region_ms": 30.0},
        "engines": [
            {"name": "eu-h100", "count": 2, "region": "eu", "capacity_rps": 10.0},
            {"name": "us-h100", "count": 2, "region": "us", "capacity_rps": 10.0},
        ],
        "workload": {
            "rate_sessions_per_s": 2.0,
            "mean_turns": 3.0,
            "think_time_s": 2.0,
            "sources": [{"name": "eu"}, {"name": "us"}],
            "tenants": [{"name": "t", "system_prompt_tokens": 200}],
        },
        "control": {"optimiser": "static", "period_s": 5.0},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return scenario_from_dict(data)


@pytest.fixture
def small_scenario() -> Scenario:
    """The default small scenario."""
    return small()


@pytest.fixture(name="small")
def small_factory():
    """``small(**overrides)``: the small scenario with top-level tables merged/replaced."""
    return small
