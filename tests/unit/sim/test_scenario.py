"""Scenario files: decoding, cross-field checks, dotted settings, shipped examples."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastroute.sim.scenario import (
    ScenarioError,
    apply_settings,
    load_scenario,
    load_scenario_dict,
    parse_setting,
    scenario_from_dict,
)

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "scenarios"


def test_minimal_scenario_gets_defaults():
    """Only an engine group is required."""
    s = scenario_from_dict({"engines": [{"name": "e"}]})
    assert s.regions[0].name == "local" and s.control.optimiser == "static"


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({}, "at least one"),
        ({"engines": [{"name": "e", "profile": "tpu"}]}, "unknown profile"),
        ({"engines": [{"name": "e", "region": "mars"}]}, "unknown region"),
        ({"engines": [{"name": "e"}], "workload": {"sources": [{"name": "x"}]}}, "not a region"),
        ({"engines": [{"name": "e"}], "workload": {"models": [{"name": "m"}]}}, "no engine"),
        ({"engines": [{"name": "e", "role": "prefill"}]}, "both prefill and decode"),
        ({"engines": [{"name": "e"}], "faults": [{"kind": "crash", "engines": ["x"]}]}, "unknown"),
        ({"engines": [{"name": "e"}], "faults": [{"kind": "partition"}]}, "two regions"),
        ({"engines": [{"name": "e"}], "dataplane": {"polcy": "x"}}, "unknown field"),
    ],
)
def test_bad_scenarios_name_the_problem(data, fragment):
    """Inconsistent references and unknown keys raise ScenarioError with a reason."""
    with pytest.raises(ScenarioError, match=fragment):
        scenario_from_dict(data)


def test_settings_parse_toml_values_and_apply_dotted_keys():
    """--set values are TOML (bare words are strings); dotted keys create tables."""
    assert parse_setting("target_load=0.8") == ("target_load", 0.8)
    assert parse_setting("control.optimiser=lp") == ("control.optimiser", "lp")
    assert parse_setting("control.params={kappa_s = 0.2}") == ("control.params", {"kappa_s": 0.2})
    data = apply_settings({"a": {"b": 1}}, {"a.c": 2, "d.e": 3})
    assert data == {"a": {"b": 1, "c": 2}, "d": {"e": 3}}
    with pytest.raises(ScenarioError, match="KEY=VALUE"):
        parse_setting("novalue")


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_scenarios_load_with_their_variants(path):
    """Every example scenario and each of its variants is valid; an experiment file
    (``fastroute sim sweep``) is valid for every case x arm."""
    if path.name.endswith("-experiment.toml"):
        from fastroute.sim.sweep import load_sweep

        sweep = load_sweep(path)
        base = load_scenario_dict(Path(sweep.base_dir) / sweep.scenario)
        for case in sweep.cases:
            for arm in sweep.arms:
                scenario_from_dict(apply_settings(apply_settings(base, case.set), arm.set))
        return
    s = load_scenario(path)
    for v in s.variants:
        load_scenario(path, dict(v.set))


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_azure_conv_excerpt_covers_the_replay_window_at_its_highest_load(seed):
    """The trace excerpt kept in the repository (5,000 rows) holds the whole window the
    replay draws at 1.2x capacity from any offset: a shorter file would silently end the
    replay early and offer less than the stated load."""
    from fastroute.sim import Simulator

    path = EXAMPLES / "azure-conv.toml"
    sim = Simulator(load_scenario(path, {"target_load": 1.2}), policy="round-robin", seed=seed)
    starts = sorted(s.start_s for s in sim.sessions)
    duration_s = sim.scenario.duration_s
    rate_rps = sim.scenario.replay.rate_rps
    assert starts[-1] > 0.95 * duration_s
    assert len(starts) == pytest.approx(rate_rps * duration_s, rel=0.1)
