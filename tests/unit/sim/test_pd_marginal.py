"""Experiment (h) at a tiny size: P/D and colocated pools with the marginal-cost policy.

Determinism, conservation, both engines of a pair seen by the policy hooks and the
in-flight counts, and calibration fed from the data plane's timings.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fastroute.hardware import PROFILES
from fastroute.policy.marginal import MarginalPairs
from fastroute.predict.calibration import FleetCalibration
from fastroute.sim.core import Simulator
from fastroute.sim.scenario import apply_settings, load_scenario_dict, scenario_from_dict
from fastroute.sim.sweep import run_sweep

ROOT = Path(__file__).resolve().parents[3]
BASE = ROOT / "examples" / "scenarios" / "pd-base.toml"
FACTORS = {"a0_s": 1.5, "b0_s": 1.5, "a1_s": 0.8, "b1_s": 0.8, "a2_s": 1.5, "a3_s": 1.5}


@pytest.fixture
def traces(tmp_path: Path, azure_csv) -> list[dict[str, Any]]:
    """Two small Azure-format traces (chat-like and code-like) instead of the shared ones."""
    conv = azure_csv(tmp_path / "conv.csv", 400, gap_s=0.3, prompt=700, out=60)
    code = azure_csv(tmp_path / "code.csv", 400, gap_s=0.5, prompt=1800, out=8)
    return [
        {"name": "conv", "path": str(conv), "share": 0.7, "max_offset": 100},
        {"name": "code", "path": str(code), "share": 0.3, "max_offset": 100},
    ]


def tiny(traces: list[dict[str, Any]], **settings: Any) -> dict[str, Any]:
    """pd-base.toml (2P+4D, Qwen2.5-3B/A40, true != datasheet), 20 s of bursty replay."""
    data = apply_settings(
        load_scenario_dict(BASE),
        {"duration_s": 20, "drain_s": 30, "warmup_s": 2, "replay.components": traces},
    )
    return apply_settings(data, settings)


def run(data: dict[str, Any], policy: str, seed: int = 1) -> Simulator:
    sim = Simulator(scenario_from_dict(data), policy=policy, seed=seed)
    sim.result = sim.run()
    return sim


def outcomes(sim: Simulator) -> list[tuple[Any, ...]]:
    return [
        (r.request_id, r.outcome, r.reason, r.engine, r.first_token_s, r.finish_s)
        for r in sim.result.records
    ]


def test_pd_marginal_is_deterministic_and_conserves_requests(traces):
    """Same seed: identical records. Every request that arrived after the warm-up ends
    exactly once (ok/shed/failed), and every in-flight count is back to zero."""
    data = tiny(traces, **{"dataplane.policy_params": {"calibrate": True}})
    a, b = run(data, "marginal-cost"), run(data, "marginal-cost")
    assert outcomes(a) == outcomes(b)
    recs = a.result.records
    expected = sum(1 for s in a.sessions if s.start_s >= a.scenario.warmup_s)
    assert len(recs) == expected > 30
    assert len({r.request_id for r in recs}) == len(recs)
    assert {r.outcome for r in recs} <= {"ok", "shed", "failed"}
    assert sum(r.outcome == "ok" for r in recs) > 0.9 * len(recs)
    dp = a.dataplanes[0]
    assert not dp.loads.any() and not dp.token_loads.any()
    # Served by a decode engine (the record names the decode side under P/D).
    assert {r.engine.split("-")[0] for r in recs if r.outcome == "ok"} == {"decode"}
    assert outcomes(run(data, "marginal-cost", seed=2)) != outcomes(a)


def test_pairs_are_chosen_through_the_pair_selector_interface(traces):
    """A pair-pricing policy ranks P/D pairs through the same PairSelector the proxy calls
    (per-pool requests: the decode request carries the decode row); other policies have
    none and rank each pool on its own."""
    data = tiny(traces, **{"dataplane.policy_params": {"calibrate": True}})
    sim = Simulator(scenario_from_dict(data), policy="marginal-cost", seed=1)
    dp = sim.dataplanes[0]
    assert isinstance(dp.pairs, MarginalPairs) and dp.pairs.policy is dp.policy
    calls: list[tuple[int, int, int]] = []
    choose_pair = dp.pairs.choose_pair

    def counting(prefill_request, decode_request, prefill, decode, k):
        calls.append((prefill_request.row, decode_request.row, k))
        return choose_pair(prefill_request, decode_request, prefill, decode, k)

    dp.pairs.choose_pair = counting
    result = sim.run()
    assert len(calls) >= sum(r.outcome == "ok" for r in result.records) > 30
    rows = {(sim.row_of[key], sim.decode_row_of[key]) for key in sim.decode_row_of}
    assert {(p, d) for p, d, _ in calls} == rows
    assert {k for *_, k in calls} == {sim.scenario.dataplane.k}
    other = Simulator(scenario_from_dict(tiny(traces)), policy="round-robin", seed=1)
    assert other.dataplanes[0].pairs is None


def test_both_engines_of_a_pair_get_the_hooks_and_the_calibration_learns(traces):
    """on_routed/on_complete are called for prefill *and* decode engines, balanced; the
    calibration saw prefill and decode timings and moved b0 from the datasheet's value
    towards the engines' true one; output lengths were observed."""
    data = tiny(traces, **{"dataplane.policy_params": {"calibrate": True}})
    sim = Simulator(scenario_from_dict(data), policy="marginal-cost", seed=1)
    pol = sim.dataplanes[0].policy
    routed: dict[int, int] = {}
    completed: dict[int, int] = {}
    orig_routed, orig_complete = pol.on_routed, pol.on_complete

    def on_routed(request, engine_id):
        routed[engine_id] = routed.get(engine_id, 0) + 1
        orig_routed(request, engine_id)

    def on_complete(request, engine_id, ok):
        completed[engine_id] = completed.get(engine_id, 0) + 1
        orig_complete(request, engine_id, ok)

    pol.on_routed, pol.on_complete = on_routed, on_complete
    sim.run()
    roles = {e.engine_id: e.role for e in sim.engines}
    assert {roles[i] for i in routed} == {"prefill", "decode"}
    assert routed == completed
    model = pol.calibration.model("a40-qwen2.5-3b")
    assert model.samples_by_kind["prefill"] > 20 and model.samples_by_kind["decode"] > 20
    true_b0 = sim.engines[0].profile.b0_s
    nominal_b0 = sim.nominal["a40-qwen2.5-3b"].b0_s
    fit_b0 = model.rls.coef[1]
    assert abs(fit_b0 - true_b0) < 0.5 * abs(nominal_b0 - true_b0)
    json.dumps(pol.calibration.to_dict())  # plain data: publishable
    assert pol.output_lengths.mean("conv", 0) > pol.output_lengths.mean("code", 0)


def test_uncalibrated_keeps_the_datasheet_constants(traces):
    """calibrate=false: the policy's constants stay nominal although timings are fed."""
    data = tiny(traces, **{"dataplane.policy_params": {"calibrate": False}})
    sim = run(data, "marginal-cost")
    model = sim.dataplanes[0].policy.calibration.model("a40-qwen2.5-3b")
    assert model.rls.coef[1] == pytest.approx(sim.nominal["a40-qwen2.5-3b"].b0_s)


def test_an_unprofiled_hardware_label_starts_from_the_default_type(traces):
    """A hardware label naming no built-in profile: the policy's type is the label and
    it starts from the default type's datasheet (a40, Llama-3-8B), as the proxy's
    FleetCalibration does; the engines still run their true (Qwen) step times, and the
    calibrated policy moves b0 from that start towards them."""
    engines = [
        {"name": "mixed", "count": 3, "profile": "a40-qwen2.5-3b", "hardware": "A40-48g",
         "model": "qwen2.5-3b", "step_time_factors": FACTORS},
    ]  # fmt: skip
    data = tiny(traces, engines=engines, **{"dataplane.policy_params": {"calibrate": True}})
    sim = run(data, "marginal-cost")
    llama, qwen = PROFILES["a40"], PROFILES["a40-qwen2.5-3b"]
    assert set(sim.nominal) == {"a40-48g"}
    assert sim.nominal["a40-48g"].b0_s == pytest.approx(llama.b0_s)
    assert sim.nominal["a40-48g"] == FleetCalibration().nominal("a40-48g")
    assert sim.engines[0].profile.b0_s == pytest.approx(1.5 * qwen.b0_s)
    model = sim.dataplanes[0].policy.calibration.model("a40-48g")
    assert model.samples_by_kind["decode"] > 20
    true_b0 = sim.engines[0].profile.b0_s
    assert abs(model.rls.coef[1] - true_b0) < 0.5 * abs(llama.b0_s - true_b0)


def test_colocated_pool_and_slo_admission(traces):
    """Three mixed engines; with SLOs the policy refuses predicted misses early (shed,
    reason slo-infeasible) and the rest are conserved."""
    engines = [
        {"name": "mixed", "count": 3, "profile": "a40-qwen2.5-3b", "model": "qwen2.5-3b",
         "step_time_factors": FACTORS},
    ]  # fmt: skip
    params = {"slo_ttft_s": 0.175, "slo_tpot_s": 0.0397}
    data = tiny(traces, engines=engines, target_load=1.5, **{"dataplane.policy_params": params})
    sim = run(data, "marginal-cost")
    recs = sim.result.records
    assert len(recs) == sum(1 for s in sim.sessions if s.start_s >= sim.scenario.warmup_s)
    shed = [r for r in recs if r.outcome == "shed"]
    assert shed and {r.reason for r in shed} == {"slo-infeasible"}
    assert all(r.attempts == 0 for r in shed)
    assert not sim.dataplanes[0].loads.any()


def test_sweep_writes_a_row_per_run(tmp_path: Path, traces):
    """The experiment command's grid: case x arm x seed rows, a report and a figure."""
    exp = tmp_path / "exp.toml"
    comps = ", ".join(
        f'{{ name = "{t["name"]}", path = "{t["path"]}", share = {t["share"]}, max_offset = 50 }}'
        for t in traces
    )
    exp.write_text(
        f'scenario = "{BASE}"\nseeds = [1, 2]\n'
        f'[[cases]]\nname = "tiny"\nset = {{ "replay.components" = [{comps}] }}\n'
        '[[arms]]\nname = "rr"\npolicy = "round-robin"\n'
        '[[arms]]\nname = "lh"\npolicy = "length-heuristic"\n'
    )
    rows = run_sweep(
        exp, tmp_path / "out", settings={"duration_s": 10, "drain_s": 20, "warmup_s": 1}
    )
    assert [(r["arm"], r["seed"]) for r in rows] == [("rr", 1), ("rr", 2), ("lh", 1), ("lh", 2)]
    assert all(0 <= r["goodput_share"] <= 1 for r in rows)
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## tiny" in report and "| lh |" in report
    assert json.loads((tmp_path / "out" / "runs.json").read_text()) == rows
