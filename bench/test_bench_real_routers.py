"""``bench/real_routers.py``: its workloads, the run's figures and the table (no engine)."""

from __future__ import annotations

import argparse
import random

from real_routers import (
    OUTPUT_TOKENS,
    Outcome,
    Words,
    policy_params,
    rag,
    sessions,
    summarize,
    table,
)

from fastroute.fleetbench.scrape import EngineCounters


def test_a_workload_is_the_same_replay_for_every_policy() -> None:
    def draw() -> list:
        return rag(Words(random.Random("1-rag")), 5.0, 20.0, 10)

    first, second = draw(), draw()
    assert first == second and 60 <= len(first) <= 140  # Poisson at 5 rps for 20 s
    documents = {c.turns[0].split("\n\nQuestion:")[0] for c in first}
    assert 2 <= len(documents) <= 10  # questions share the documents they are asked on


def test_sessions_grow_by_appends_below_the_context() -> None:
    convs = sessions(Words(random.Random(3)), 1.0, 30.0)
    assert convs and all(len(c.turns) >= 5 for c in convs)
    for c in convs:
        words = len(c.system.split()) + sum(len(t.split()) for t in c.turns)
        assert words + OUTPUT_TOKENS * len(c.turns) < 2048 - OUTPUT_TOKENS


def test_the_figures_count_misses_and_the_engines_own_counters() -> None:
    args = argparse.Namespace(ttft_slo_s=1.0, tbot_slo_s=0.1)
    outcomes = [
        Outcome(0, 0, ttft_s=0.2, tbot_s=0.02, tokens=32),
        Outcome(1, 0, ttft_s=1.5, tbot_s=0.02, tokens=32),  # TTFT miss
        Outcome(2, 0, ttft_s=0.3, tbot_s=0.2, tokens=32),  # TBOT miss
        Outcome(3, 0, error="APIConnectionError: x"),
    ]

    def counters(requests: float, queries: float, hits: float) -> EngineCounters:
        return EngineCounters(
            requests=requests, prefix_queries_tokens=queries, prefix_hits_tokens=hits,
            prompt_tokens=0.0, generation_tokens=0.0,
        )  # fmt: skip

    before = [counters(5.0, 100.0, 10.0)] * 2
    after = [counters(8.0, 400.0, 160.0), counters(6.0, 200.0, 10.0)]
    got = summarize(outcomes, before, after, args)
    assert got["goodput"] == 0.25 and got["errors"] == 1
    assert got["error_kinds"] == {"APIConnectionError": 1}
    assert got["engine_prefix_hit_rate"] == 150.0 / 400.0
    assert got["served_per_engine"] == [3.0, 1.0] and got["max_min_served"] == 3.0
    assert got["ttft_p50_s"] == 0.3


def test_the_table_has_each_repeat_and_the_mean() -> None:
    run = {
        "goodput": 0.5,
        "ttft_p50_s": 0.1,
        "ttft_p99_s": 0.9,
        "tbot_p99_s": 0.05,
        "engine_prefix_hit_rate": 0.25,
        "max_min_served": 1.5,
        "router_cpu_ms_per_request": 1.0,
    }
    second = run | {"goodput": 0.7}
    lines = table({"runs": {"rag": {"prefix-hrw": [run, second], "round-robin": []}}}).splitlines()
    assert (
        lines[2]
        == "| rag | prefix-hrw | 0.600 (0.500 / 0.700) | 100 / 900 | 50 | 25.0 % | 1.50 | 1.00 |"
    )
    assert len(lines) == 3  # a policy without runs has no row


def test_a_router_name_carries_its_policys_tunables() -> None:
    name = "fastroute:prefix-hrw@stall_weight=0.3,balance_factor=3,block_bytes=1024"
    params = {"stall_weight": 0.3, "balance_factor": 3, "block_bytes": 1024}
    assert policy_params(name) == ("fastroute:prefix-hrw", params)
    assert policy_params("vllm-router:cache_aware") == ("vllm-router:cache_aware", {})
