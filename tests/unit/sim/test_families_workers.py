"""The simulator's workload families and its proxies × workers data-plane model."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest

from fastroute.sim import Simulator
from fastroute.sim.core import _Session
from fastroute.sim.scenario import ScenarioError, scenario_from_dict

REPO = Path(__file__).resolve().parents[3]


def family_scenario(family: dict[str, Any], **overrides: Any):
    data: dict[str, Any] = {
        "name": "family",
        "duration_s": 40.0,
        "drain_s": 60.0,
        "warmup_s": 5.0,
        "engines": [
            {"name": "a40", "count": 4, "profile": "a40-qwen2.5-3b", "model": "qwen2.5-3b"}
        ],
        "family": family,
        "control": {"optimiser": "static"},
    }
    data.update(overrides)
    return scenario_from_dict(data)


CHAT = {
    "kind": "chat",
    "rate_rps": 4.0,
    "workload": {
        "mean_turns": 6,
        "think_time_s": 3,
        "max_context_tokens": 16000,
        "tenants": [{"name": "a", "system_prompt_tokens": 1000}],
    },
}


def engine_hit_rate(sim: Simulator) -> float:
    hits = queried = 0
    for e in sim.engines:
        h, q = e.cache_hit_tokens
        hits, queried = hits + h, queried + q
    return hits / queried


def run(policy: str, workers: int, proxies: int, family=CHAT, seed: int = 1):
    sc = family_scenario(family, dataplane={"workers": workers, "proxies": proxies})
    sim = Simulator(sc, policy=policy, seed=seed)
    return sim, sim.run()


def test_cache_aware_trees_fragment_across_workers_while_weighted_hrw_does_not():
    rates = {}
    for policy in ("cache-aware", "weighted-hrw"):
        for workers, proxies in ((1, 1), (4, 2)):
            sim, result = run(policy, workers, proxies)
            assert len(sim.dataplanes) == workers * proxies
            assert sum(r.outcome == "ok" for r in result.records) > 100
            rates[policy, workers] = engine_hit_rate(sim)
    # Each of cache-aware's 8 trees sees ~1/8 of a session's turns: affinity is lost.
    assert rates["cache-aware", 4] < rates["cache-aware", 1] - 0.08
    # Weighted HRW keys on the session alone: the same engine whichever worker routes.
    assert rates["weighted-hrw", 4] == pytest.approx(rates["weighted-hrw", 1], abs=0.01)


def test_workers_of_a_proxy_share_in_flight_counts_and_proxies_do_not():
    sim, result = run("least-request", 3, 2, family={"kind": "hot-prompt", "rate_rps": 3.0})
    assert all(r.outcome == "ok" for r in result.records)  # all served: nothing in flight
    (proxies,) = sim.proxies_by_region.values()
    assert len(proxies) == 2 and all(len(p) == 3 for p in proxies)
    for workers in proxies:
        assert all(w.loads is workers[0].loads for w in workers)
        assert all(w.token_loads is workers[0].token_loads for w in workers)
        assert len({id(w.policy) for w in workers}) == 3
        assert not workers[0].loads.any() and not workers[0].token_loads.any()
    assert proxies[0][0].loads is not proxies[1][0].loads


def test_proxies_that_poll_each_other_see_the_others_queued_prompt_tokens():
    long_prompts = {"kind": "long-tail", "rate_rps": 1.5}
    sc = family_scenario(
        long_prompts, dataplane={"workers": 2, "proxies": 2, "peer_poll_interval_s": 0.25}
    )
    sim = Simulator(sc, policy="prefix-hrw", seed=1)
    (proxies,) = sim.proxies_by_region.values()
    a, b = proxies[0][0], proxies[1][0]
    assert a.proxy.peer_queued is not None and a.view.peer_queued is a.proxy.peer_queued
    # A poll copies the other proxy's queue as it is now; the view adds it to the own.
    b.queued_loads[:] = [0, 7000, 0, 0]
    a.queued_loads[:] = [100, 0, 0, 0]
    a.proxy.polled([b.proxy])
    assert a.view.queued_tokens().tolist() == [100, 7000, 0, 0]
    assert a.queued_loads.tolist() == [100, 0, 0, 0]  # the own count is untouched
    b.queued_loads[:] = 0  # b's prefill ends: a holds the old figure until its next poll
    assert a.view.queued_tokens().tolist() == [100, 7000, 0, 0]
    a.proxy.polled([b.proxy])
    assert a.view.queued_tokens().tolist() == [100, 0, 0, 0]
    a.queued_loads[:] = 0

    seen = []
    poll = sim._on_poll

    def record(t, proxy):
        poll(t, proxy)
        seen.append((t, int(proxy.peer_queued.sum())))

    sim._on_poll = record
    result = sim.run()
    assert sum(r.outcome == "ok" for r in result.records) > 20
    # Each proxy polls every 0.25 s through the run, and sometimes finds a queue.
    assert len(seen) >= 2 * (sc.duration_s + sc.drain_s) / 0.25 * 0.9
    assert any(tokens > 0 for _, tokens in seen)


def test_proxies_without_peer_polls_see_their_own_queue_only():
    sim, _ = run("prefix-hrw", 1, 2, family={"kind": "hot-prompt", "rate_rps": 2.0})
    assert all(dp.proxy.peer_queued is None for dp in sim.dataplanes)
    assert all(dp.view.peer_queued is None for dp in sim.dataplanes)


def test_workers_of_a_proxy_count_each_others_requests_through_the_key_log():
    """With the key log (the default) every prefix-hrw worker's share table counts the
    proxy's routed requests; without it, about its own quarter."""
    hot_prompt = {"kind": "hot-prompt", "rate_rps": 3.0}
    counts = {}
    for entries in (4096, 0):
        sc = family_scenario(hot_prompt, dataplane={"workers": 4, "key_log_entries": entries})
        sim = Simulator(sc, policy="prefix-hrw", seed=1)
        assert all((dp.proxy.key_log is not None) == bool(entries) for dp in sim.dataplanes)
        sim.run()
        requests = [dp.policy.hot.requests for dp in sim.dataplanes]
        log = sim.dataplanes[0].proxy.key_log
        routed = memoryview(log).cast("Q")[4] if log is not None else sum(requests)
        counts[entries] = (routed, requests)
    routed, requests = counts[4096]
    # Each worker has drained the others' entries up to its own last decision.
    assert routed > 50 and all(0.9 * routed <= n <= routed for n in requests), counts
    routed, requests = counts[0]
    assert max(requests) < 0.5 * routed, counts


def test_proxies_that_poll_each_other_count_each_others_requests_through_the_exchange():
    """With peer polls the proxies pass each other their own key-log entries (the default
    ``peer_key_exchange``): each proxy's tables count the deployment's requests, one worker
    per proxy included; without the exchange, about its own half."""
    hot_prompt = {"kind": "hot-prompt", "rate_rps": 3.0}
    counts = {}
    for exchange in (True, False):
        dataplane = {"proxies": 2, "peer_poll_interval_s": 0.25, "peer_key_exchange": exchange}
        sim = Simulator(family_scenario(hot_prompt, dataplane=dataplane), policy="prefix-hrw")
        assert all((dp.proxy.exchange is not None) == exchange for dp in sim.dataplanes)
        sim.run()
        counts[exchange] = [dp.policy.hot.requests for dp in sim.dataplanes]
    both, apart = counts[True], counts[False]
    routed = sum(apart)  # apart, each proxy's table counts the requests it routed
    assert routed > 50 and max(apart) < 0.7 * routed, counts
    # Exchanged: what it routed plus what the other routed up to its last poll.
    assert all(0.9 * routed <= n <= routed for n in both), counts


def test_worker_assignment_is_seeded_and_deterministic():
    _, a = run("cache-aware", 4, 2, seed=3)
    _, b = run("cache-aware", 4, 2, seed=3)
    key = [(r.request_id, r.engine, r.first_token_s) for r in a.records]
    assert key == [(r.request_id, r.engine, r.first_token_s) for r in b.records]


def test_route_prefix_reflects_the_familys_sharing():
    sc = family_scenario({"kind": "rag", "documents": 4, "zipf_s": 0.0})
    sim = Simulator(sc, policy="cache-aware", seed=1)
    limit = sim.dataplanes[0].policy.prefix_bytes
    by_doc: dict[str, list[bytes]] = {}
    for s in sim.sessions[:60]:
        prefix = Simulator._prefix(_Session(s, sim.dataplanes[0]), 0, limit)
        assert len(prefix) == min(limit, len(s.turns[0].user_text))
        assert prefix == s.turns[0].user_text.encode()[:limit]  # no system prompt here
        by_doc.setdefault(s.turns[0].user_text.split("]")[0], []).append(prefix)
    assert len(by_doc) > 1
    for group in by_doc.values():
        # Documents are longer than the prefix: one document, one prefix.
        long_ones = {p for p in group if len(p) == limit}
        assert len(long_ones) <= 1
    firsts = [next(iter(g)) for g in by_doc.values()]
    assert len(os.path.commonprefix(firsts)) < 16


def test_target_load_sets_the_familys_rate_from_capacity():
    sc = family_scenario({"kind": "hot-prompt"}, target_load=0.8)
    sim = Simulator(sc, policy="round-robin", seed=1)
    capacity = sum(e.capacity_rps for e in sim.engines)
    # (capacity is re-estimated on the scaled sessions' shapes: a resample, close)
    assert sim.scenario.family.rate_rps == pytest.approx(0.8 * capacity, rel=0.05)
    offered = len(sim.sessions) / sc.duration_s
    assert offered == pytest.approx(0.8 * capacity, rel=0.25)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"dataplane": {"workers": 0}}, "workers >= 1"),
        ({"dataplane": {"proxies": 0}}, "proxies >= 1"),
        ({"dataplane": {"peer_poll_interval_s": -1}}, "peer_poll_interval_s must be >= 0"),
        ({"dataplane": {"key_log_entries": 24}}, "key_log_entries must be 0 or a power"),
        ({"family": {"kind": "rag", "model": "llama-3-8b"}}, "served by no engine"),
        ({"trace": {"path": "x.csv"}}, "[family] excludes"),
        ({"family": {"kind": "rag", "documents": -1}}, "documents must be >= 1"),
    ],
)
def test_scenario_errors(overrides, message):
    base = {"family": {"kind": "rag"}}
    with pytest.raises(ScenarioError, match=message.replace("[", r"\[").replace("]", r"\]")):
        family_scenario(**{**base, **overrides})


def test_family_scenario_files_load():
    from fastroute.sim.scenario import load_scenario

    paths = sorted((REPO / "examples" / "scenarios" / "families").glob("*.toml"))
    assert len(paths) == 8
    for path in paths:
        sc = load_scenario(path)
        assert sc.family is not None and sc.target_load == 0.7
        assert {v.name for v in sc.variants} == {"load-70", "load-90"}


def _policy_matrix():
    """``bench/policy_matrix.py`` as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "policy_matrix", REPO / "bench" / "policy_matrix.py"
    )
    matrix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(matrix)
    return matrix


def test_policy_matrix_quick_mode_on_a_tiny_case(tmp_path, capsys):
    matrix = _policy_matrix()
    argv = [
        "--quick",
        "--families",
        "hot-prompt",
        "--routers",
        "round-robin",
        "--out",
        str(tmp_path),
    ]
    assert matrix.main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["quick"] and results["runs"] == 2
    configs = {(r["workers"], r["proxies"]) for r in results["results"]}
    assert configs == {(1, 1), (4, 2)}
    for r in results["results"]:
        assert r["requests"] > 0 and r["goodput_rps"] > 0
        assert 0 < r["engine_prefix_hit_rate"] < 1  # the hot system prompt is reused
        assert sum(r["served_per_engine"]) > 0 and r["load_ratio_max_min"] >= 1
    table = (tmp_path / "hot-prompt.md").read_text()
    assert table.count("| round-robin |") == 2 and "engine prefix hit" in table
    assert "## hot-prompt" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        matrix.main(["--quick", "--policies", "no-such-policy", "--out", str(tmp_path)])


def test_policy_matrix_configs_and_settings(tmp_path):
    matrix = _policy_matrix()
    argv = ["--quick", "--families", "hot-prompt", "--routers", "round-robin"]
    args = matrix.parse_args(
        [*argv, "--configs", "8x1", "--set", "dataplane.peer_poll_interval_s=1", "--out", "x"]
    )
    (cell,) = matrix.build_cells(args)
    assert (cell["workers"], cell["proxies"]) == (8, 1)
    assert cell["settings"]["dataplane.peer_poll_interval_s"] == 1
    assert cell["label"] == "round-robin dataplane.peer_poll_interval_s=1"
    with pytest.raises(SystemExit):
        matrix.parse_args([*argv, "--set", "no-equals-sign"])


def test_policy_matrix_takes_a_scenario_path_as_a_family():
    """A ``--families`` entry ending in ``.toml`` is a scenario file, named by its stem
    (the Azure trace replay); a name is a family under ``FAMILY_DIR``."""
    matrix = _policy_matrix()
    replay = str(REPO / "examples" / "scenarios" / "azure-conv.toml")
    args = matrix.parse_args(["--families", f"rag,{replay}", "--routers", "round-robin"])
    cells = matrix.build_cells(args)
    assert {(c["family"], c["path"]) for c in cells} == {
        ("rag", str(matrix.FAMILY_DIR / "rag.toml")),
        ("azure-conv", replay),
    }
    with pytest.raises(SystemExit):
        matrix.parse_args(["--families", "examples/no-such-scenario.toml"])
