"""The simulator's two P/D protocols: vLLM's sequential steps and SGLang's concurrent
dispatch differ by the data plane's round trip between prefill and decode, only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from fastroute.sim import Simulator
from fastroute.sim.scenario import Scenario, ScenarioError
from fastroute.workload import Session, Turn
from fastroute.workload.session import make_text

INTRA_MS, INTER_MS = 2.0, 30.0


def _run(small: Callable[..., Scenario], kind: str, source: str) -> tuple[Any, Simulator]:
    """One 300-token request from ``source`` to a P/D pair in eu, engines of ``kind``."""
    scenario = small(
        network={"intra_region_ms": INTRA_MS, "inter_region_ms": INTER_MS},
        engines=[
            {"name": "p", "region": "eu", "role": "prefill", "kind": kind, "capacity_rps": 5.0},
            {"name": "d", "region": "eu", "role": "decode", "kind": kind, "capacity_rps": 5.0},
        ],
    )
    session = Session(
        session_id="x",
        tenant="t",
        source=source,
        model="demo-8b",
        start_s=1.0,
        system_prompt="",
        turns=(Turn(user_text=make_text("x", 300), user_tokens=300, max_tokens=20),),
    )
    sim = Simulator(scenario, sessions=[session], seed=1)
    (record,) = sim.run().records
    return record, sim


@pytest.mark.parametrize(("source", "one_way_ms"), [("eu", INTRA_MS), ("us", INTER_MS)])
def test_sglang_saves_the_data_planes_round_trip_and_nothing_else(
    small: Callable[..., Scenario], source: str, one_way_ms: float
) -> None:
    """Same request, same engines: SGLang's first token (and every later one) comes one
    round trip data plane <-> engines earlier (prefill answer back, decode request out);
    every other figure of the request and of the engines is the same."""
    nixl, nixl_sim = _run(small, "vllm", source)
    boot, boot_sim = _run(small, "sglang", source)
    assert nixl.outcome == boot.outcome == "ok"
    saved_s = 2 * one_way_ms / 1000.0
    assert nixl.ttft_s - boot.ttft_s == pytest.approx(saved_s, abs=1e-9)
    assert nixl.e2e_s - boot.e2e_s == pytest.approx(saved_s, abs=1e-9)
    timing = {"first_token_s", "finish_s"}
    same = {k: v for k, v in msgspec.structs.asdict(nixl).items() if k not in timing}
    assert same == {k: v for k, v in msgspec.structs.asdict(boot).items() if k not in timing}
    steps = [(e.name, e.steps, e.busy_s) for e in nixl_sim.engines]
    assert steps == [(e.name, e.steps, e.busy_s) for e in boot_sim.engines]
    assert boot_sim.pd_protocols == {"demo-8b": "bootstrap"}
    assert nixl_sim.pd_protocols == {"demo-8b": "nixl"}


def test_a_pd_model_mixing_kinds_is_refused(small: Callable[..., Scenario]) -> None:
    with pytest.raises(ScenarioError, match="different P/D protocols"):
        small(
            engines=[
                {"name": "p", "region": "eu", "role": "prefill", "kind": "sglang"},
                {"name": "d", "region": "eu", "role": "decode", "kind": "vllm"},
            ]
        )
