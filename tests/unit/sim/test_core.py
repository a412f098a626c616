"""The simulator: determinism, conservation, analytic latency, shared code paths, faults."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from fastroute.guards import admission, outlier, retry_budget
from fastroute.hardware import get_profile
from fastroute.policy import POLICIES
from fastroute.sim import Simulator, summarize
from fastroute.sim.fleet import DataPlane
from fastroute.tokens import count_text_tokens, render_chat
from fastroute.workload import Session, Turn
from fastroute.workload.session import make_text


def _run(scenario, **kw):
    return Simulator(scenario, **kw).run()


def test_same_seed_same_metrics_other_seed_differs(small_scenario):
    """Two runs with one seed give identical records and summaries; another seed differs."""
    a = _run(small_scenario, seed=3)
    b = _run(small_scenario, seed=3)
    c = _run(small_scenario, seed=4)
    assert a.records == b.records and a.engines == b.engines
    assert summarize(a.records) == summarize(b.records)
    assert [r.request_id for r in a.records] != [r.request_id for r in c.records]


def test_fast_forward_changes_nothing_but_speed(small_scenario):
    """Decode fast-forward gives the same records as stepping every step, in fewer heap events."""
    ff = _run(small_scenario, seed=5)
    slow = _run(small_scenario, seed=5, fast_forward=False)
    assert ff.records == slow.records
    assert ff.steps == slow.steps
    assert ff.heap_events < slow.heap_events


def test_every_request_ends_exactly_once_under_faults(small):
    """Conservation: with a crash, an error burst, a partition and a controller outage, every
    turn sent is recorded once, as ok, shed or failed; later turns only follow served ones."""
    scenario = small(
        faults=[
            {"kind": "crash", "engines": ["eu-h100-0"], "start_s": 10.0, "duration_s": 10.0},
            {
                "kind": "errors",
                "engines": ["eu-h100", "us-h100"],
                "start_s": 5.0,
                "duration_s": 10.0,
                "error_rate": 0.5,
            },
            {"kind": "partition", "regions": ["eu", "us"], "start_s": 20.0, "duration_s": 5.0},
            {"kind": "controller-outage", "start_s": 0.0, "duration_s": 20.0},
            {"kind": "slowdown", "engines": ["us-h100-1"], "start_s": 25.0, "factor": 3.0},
        ],
        dataplane={"retry": "fixed", "max_attempts": 2},
    )
    sim = Simulator(scenario, seed=2)
    result = sim.run()
    ids = Counter(r.request_id for r in result.records)
    assert all(n == 1 for n in ids.values())
    assert {r.outcome for r in result.records} <= {"ok", "shed", "failed"}
    outcomes = Counter(r.outcome for r in result.records)
    assert outcomes["ok"] > 0 and outcomes["failed"] > 0  # the faults did bite
    assert any(r.attempts > 1 for r in result.records)
    by_session: dict[str, list] = {}
    for r in result.records:
        by_session.setdefault(r.session_id, []).append(r)
    expected = 0
    for s in sim.sessions:
        recs = sorted(by_session.get(s.session_id, []), key=lambda r: r.turn)
        assert [r.turn for r in recs] == list(range(len(recs)))
        # A session stops at its first unserved turn, else runs all its turns.
        served = [r.outcome == "ok" for r in recs]
        assert all(served[:-1])
        assert len(recs) == len(s.turns) or not served[-1]
        expected += len(recs)
    assert expected == len(result.records)


def test_single_request_matches_the_model_latency(small):
    """One request alone on one engine: TTFT = 2·latency + one prefill step, and e2e adds
    one decode step per further token, from the profile's coefficients."""
    scenario = small(
        regions=[{"name": "eu"}],
        engines=[{"name": "e", "count": 1, "region": "eu", "capacity_rps": 5.0}],
        network={"intra_region_ms": 2.0},
        workload={"sources": [{"name": "eu"}]},
    )
    n_out = 40
    session = Session(
        session_id="x",
        tenant="t",
        source="eu",
        model="demo-8b",
        start_s=1.0,
        system_prompt="",
        turns=(Turn(user_text=make_text("x", 300), user_tokens=300, max_tokens=n_out),),
    )
    result = Simulator(scenario, sessions=[session], seed=1).run()
    (r,) = result.records
    p = get_profile("h100")
    prompt = count_text_tokens(render_chat(session.messages(0, [])))
    assert r.prompt_tokens == prompt
    prefill = p.a0_s + p.a1_s * prompt + p.a2_s * prompt**2
    decode = sum(p.b0_s + p.b1_s + p.b2_s * (prompt + j) for j in range(1, n_out))
    assert r.ttft_s == pytest.approx(0.004 + prefill, rel=1e-9)
    assert r.e2e_s == pytest.approx(0.004 + prefill + decode, rel=1e-9)
    assert r.outcome == "ok" and r.output_tokens == n_out and r.cached_tokens == 0


def test_data_planes_run_the_proxys_objects(monkeypatch, small_scenario):
    """The policy, retry budget, ejection and shedding objects are the proxy's own classes,
    and the simulator routes through the registry policy's choose()."""
    calls = Counter()
    cls = POLICIES["weighted-hrw"]
    original = cls.choose

    def counting(self, request, view, k=3):
        calls["choose"] += 1
        return original(self, request, view, k)

    monkeypatch.setattr(cls, "choose", counting)
    real_shed = admission.should_shed

    def counting_shed(key, fraction):
        calls["shed"] += 1
        return real_shed(key, fraction)

    monkeypatch.setattr("fastroute.sim.core.should_shed", counting_shed)
    sim = Simulator(small_scenario, policy="weighted-hrw", seed=1)
    for dp in sim.dataplanes:
        assert isinstance(dp, DataPlane)
        assert type(dp.policy) is cls
        assert type(dp.budget) is retry_budget.RetryBudget
        assert type(dp.outlier) is outlier.OutlierDetector
    result = sim.run()
    attempts = sum(r.attempts for r in result.records)
    assert calls["choose"] == attempts > 0
    assert calls["shed"] == len(result.records)


def test_crash_fails_over_and_ejects(small):
    """A crashed engine's requests fail over to other engines; the data plane ejects it."""
    scenario = small(
        faults=[{"kind": "crash", "engines": ["eu-h100-0"], "start_s": 5.0, "duration_s": 100.0}],
        dataplane={"consecutive_failures": 2},
    )
    sim = Simulator(scenario, seed=1)
    result = sim.run()
    after = [r for r in result.records if r.arrival_s > 15.0 and r.outcome == "ok"]
    assert after and all(r.engine != "eu-h100-0" for r in after)
    assert any(dp.outlier.ejections_total for dp in sim.dataplanes)
    ok = sum(r.outcome == "ok" for r in result.records)
    assert ok / len(result.records) > 0.95  # retries and ejection hide the crash


def test_fixed_retries_amplify_more_than_the_budget(small):
    """Retry storm in miniature: 50 % errors everywhere, 3 fixed attempts vs the budget."""
    faults = [{"kind": "errors", "engines": ["eu-h100", "us-h100"], "error_rate": 0.5}]
    fixed = small(
        faults=faults, dataplane={"retry": "fixed", "max_attempts": 3, "outlier_ejection": False}
    )
    budget = small(
        faults=faults,
        dataplane={
            "retry": "budget",
            "max_attempts": 3,
            "outlier_ejection": False,
            "min_retries_per_s": 0.1,
        },
    )
    amp_fixed = summarize(_run(fixed, seed=1).records)["overall"]["load_amplification"]
    amp_budget = summarize(_run(budget, seed=1).records)["overall"]["load_amplification"]
    assert amp_fixed == pytest.approx(1.75, abs=0.12)  # 1 + 0.5 + 0.25
    assert amp_budget < 1.25


def test_shed_fraction_from_the_control_plane_is_sticky_per_session(small):
    """A published shed fraction sheds whole sessions: a shed session never gets served."""
    from fastroute.sim.control import ControlOutput

    def shed_half(inp):
        w = inp.eligible / inp.eligible.sum(axis=1, keepdims=True)
        return ControlOutput(w, np.full(len(inp.class_labels), 0.5))

    result = Simulator(small(), seed=1, optimiser=shed_half).run()
    late = [r for r in result.records if r.arrival_s > 10.0]
    shed_sessions = {r.session_id for r in late if r.outcome == "shed"}
    served_sessions = {r.session_id for r in late if r.outcome == "ok"}
    assert shed_sessions and served_sessions and not shed_sessions & served_sessions
    assert 0.3 < len(shed_sessions) / len(shed_sessions | served_sessions) < 0.7


def test_disaggregated_prefill_decode_serves_every_request(small):
    """P/D pools: prefill on one pool, KV transfer, decode on the other; all requests served,
    each decode engine receives transferred prompts (no prefix-cache figure on decode)."""
    scenario = small(
        regions=[{"name": "eu"}],
        engines=[
            {"name": "p", "count": 2, "region": "eu", "role": "prefill", "capacity_rps": 10.0},
            {"name": "d", "count": 2, "region": "eu", "role": "decode", "capacity_rps": 10.0},
        ],
        workload={"sources": [{"name": "eu"}], "rate_sessions_per_s": 1.0},
    )
    sim = Simulator(scenario, seed=1)
    result = sim.run()
    assert result.records and all(r.outcome == "ok" for r in result.records)
    assert {r.engine for r in result.records} <= {"d-0", "d-1"}
    steps = {e["name"]: e["steps"] for e in result.engines}
    assert all(steps[n] > 0 for n in ("p-0", "p-1", "d-0", "d-1"))
    assert sim.class_labels == ("eu/demo-8b", "eu/demo-8b/decode")


def test_queue_delay_guard_sheds_under_overload(small):
    """With the queue-delay guard on, a load above its slots is shed at admission (reason
    queue-delay or queue-timeout) and every admitted request is served; without shedding
    nothing is shed."""
    over = {"rate_sessions_per_s": 25.0, "sources": [{"name": "eu"}, {"name": "us"}]}
    # No prefix caching: capacity is then what the engines' capacity_rps says (10 req/s).
    engines = [
        {"name": "eu-h100", "count": 2, "region": "eu", "enable_prefix_caching": False},
        {"name": "us-h100", "count": 2, "region": "us", "enable_prefix_caching": False},
    ]
    guarded = small(workload=over, engines=engines, dataplane={"max_concurrency": 64})
    open_ = small(workload=over, engines=engines, dataplane={"shedding": False})
    g = _run(guarded, seed=1).records
    o = _run(open_, seed=1).records
    shed = [r for r in g if r.outcome == "shed"]
    assert shed and {r.reason for r in shed} <= {"queue-delay", "queue-timeout"}
    end_s = guarded.duration_s + guarded.drain_s
    served = [r for r in g if r.outcome != "shed"]
    cut = [r for r in served if r.reason == "unfinished"]  # still running when the run ended
    assert all(r.outcome == "ok" for r in served if r not in cut)
    assert all(r.arrival_s > end_s - 5.0 for r in cut)  # a late turn of a long session
    assert not any(r.outcome == "shed" for r in o)


def test_spike_fault_multiplies_the_session_rate(small):
    """A spike fault is a workload burst: the sources it names get `factor` x the sessions."""
    spiked = small(
        faults=[
            {"kind": "spike", "start_s": 10.0, "duration_s": 20.0, "factor": 4.0, "regions": ["eu"]}
        ]
    )
    sessions = Simulator(spiked, seed=1).sessions
    base = Simulator(small(), seed=1).sessions

    def count(ss, region, lo, hi):
        return sum(s.source == region and lo <= s.start_s < hi for s in ss)

    assert count(sessions, "eu", 10, 30) > 2.5 * count(base, "eu", 10, 30)
    assert count(sessions, "us", 10, 30) == count(base, "us", 10, 30)


def test_mid_stream_migration_keeps_the_first_token_and_costs_a_recomputed_prefill(small):
    """A crash mid-stream: with ``max_migrations`` the broken streams go on on another
    engine (their TTFT is the first segment's, every token asked for arrives, the tokens
    generated before the crash are prefilled again); without, they are retried whole
    (a TTFT after the crash). Up to the crash both runs are the same."""

    def run(max_migrations: int):
        scenario = small(
            faults=[
                {"kind": "crash", "engines": ["eu-h100-0"], "start_s": 10.0, "duration_s": 100.0}
            ],
            dataplane={"consecutive_failures": 2, "max_migrations": max_migrations},
            workload={"rate_sessions_per_s": 6.0},
        )
        return {r.request_id: r for r in Simulator(scenario, seed=1).run().records}

    whole, migrated = run(0), run(1)
    assert not any(r.migrations for r in whole.values())
    moved = [r for r in migrated.values() if r.migrations]
    assert len(moved) >= 3
    for r in moved:
        w = whole[r.request_id]
        assert r.outcome == w.outcome == "ok" and r.migrations == 1
        assert r.output_tokens == w.output_tokens  # every token asked for
        assert 0 < r.migrated_tokens < r.output_tokens
        assert r.first_token_s < 10.0 < w.first_token_s  # the client had its first token
        assert r.attempts == w.attempts == 2


@pytest.mark.parametrize("hedge", [False, True])
def test_queued_prompt_tokens_are_released_once_per_attempt(small, monkeypatch, hedge):
    """Every attempt's queued prompt leaves its engine's count exactly once (first token,
    P/D answer, failure or a hedge's cancellation): after a run with a crash, errors and
    (optionally) hedged races every count is back at 0, and it was not 0 meanwhile."""
    peak = [0]
    prefilled = DataPlane.prefilled

    def watch(self, index, queued_tokens):
        peak[0] = max(peak[0], int(self.queued_loads.max()))
        prefilled(self, index, queued_tokens)

    monkeypatch.setattr(DataPlane, "prefilled", watch)
    scenario = small(
        faults=[
            {"kind": "crash", "engines": ["eu-h100-0"], "start_s": 5.0, "duration_s": 10.0},
            {"kind": "errors", "engines": ["us-h100"], "start_s": 5.0, "error_rate": 0.3},
            # 5x: slow enough that some first tokens are late enough to hedge although
            # the default policy steers around the slow engine's queue
            {"kind": "slowdown", "engines": ["us-h100-1"], "start_s": 0.0, "factor": 5.0},
        ],
        dataplane={"hedge": hedge, "workers": 2},
    )
    sim = Simulator(scenario, seed=2)
    records = sim.run().records
    assert peak[0] > 0
    assert any(r.attempts > 1 for r in records)  # failed attempts were released and retried
    assert any(r.hedged for r in records) == hedge  # and hedged races, when on
    for dp in sim.dataplanes:
        assert dp.queued_loads.tolist() == [0] * len(dp.queued_loads)
        assert dp.view.queued_tokens() is dp.queued_loads


def test_data_planes_see_the_engines_prefill_cost_from_their_capacities(small):
    """As the proxy derives it from ``capacity_rps``: the fastest engine 1, each other the
    fastest's capacity over its own; engines of equal capacity are alike (None)."""
    assert all(dp.view.prefill_cost() is None for dp in Simulator(small(), seed=1).dataplanes)
    scenario = small(
        engines=[
            {"name": "eu-h100", "count": 2, "region": "eu", "capacity_rps": 20.0},
            {"name": "us-h100", "count": 2, "region": "us", "capacity_rps": 5.0},
        ]
    )
    for dp in Simulator(scenario, seed=1).dataplanes:
        assert dp.view.prefill_cost().tolist() == [1.0, 1.0, 4.0, 4.0]
