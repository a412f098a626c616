"""The fleet benchmark's SLO capacity: the bisected rate where SLO attainment crosses the bar."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastroute.fleetbench.capacity import replay_at_rate, slo_capacity_rps
from fastroute.fleetbench.spec import load_spec
from fastroute.workload import ChatWorkload

SPEC = Path(__file__).resolve().parents[3] / "examples" / "bench" / "chat-70.toml"


@pytest.mark.slow
def test_slo_capacity_is_where_attainment_crosses_the_bar() -> None:
    """At the capacity ≥ 90 % of requests meet both SLOs; one bisection step above, fewer."""
    spec = load_spec(SPEC)
    workload = ChatWorkload.from_dict(spec.workload)
    slo = {"ttft_slo_s": spec.slo.ttft_s, "tbot_slo_s": spec.slo.tbot_s, "seed": spec.seed}
    idle = replay_at_rate("a40", workload, rate_rps=1.0, duration_s=60.0, **slo)
    assert idle.requests > 0 and idle.refused == 0 and idle.slo_attainment == 1.0
    cap = slo_capacity_rps("a40", workload, duration_s=60.0, hi_rps=32.0, iterations=5, **slo)
    assert 1.0 < cap < 31.0
    at = replay_at_rate("a40", workload, rate_rps=cap, duration_s=60.0, **slo)
    above = replay_at_rate("a40", workload, rate_rps=cap + 1.0, duration_s=60.0, **slo)
    assert at.slo_attainment >= 0.9 > above.slo_attainment
