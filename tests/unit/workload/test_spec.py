"""ChatWorkload decoding and validation."""

from __future__ import annotations

import tomllib

import pytest

from fastroute.workload import Burst, ChatWorkload, Diurnal, LogNormal, WorkloadError


def test_defaults_decode_from_an_empty_table():
    """Every field is defaulted: {} is a valid workload equal to ChatWorkload()."""
    assert ChatWorkload.from_dict({}) == ChatWorkload()


def test_toml_table_decodes_nested_parts():
    """A TOML scenario table converts into the Struct tree, nested structs included."""
    doc = tomllib.loads(
        """
        rate_sessions_per_s = 3.0
        arrival = "gamma"
        arrival_cv = 2.0
        prompt_tokens = {median = 100, sigma = 0.5, min = 8, max = 512}
        tenants = [{name = "a", weight = 2, system_prompt_tokens = 64}, {name = "b"}]
        sources = [{name = "eu"}, {name = "us", weight = 3}]
        diurnal = {period_s = 600, amplitude = 0.4, phase_s = {us = 300}}
        bursts = [{start_s = 10, duration_s = 5, rate_multiplier = 4}]
        """
    )
    w = ChatWorkload.from_dict(doc)
    assert w.arrival == "gamma" and w.prompt_tokens == LogNormal(
        median=100, sigma=0.5, min=8, max=512
    )
    assert [t.name for t in w.tenants] == ["a", "b"] and w.tenants[1].system_prompt_tokens == 256
    assert w.diurnal == Diurnal(period_s=600, amplitude=0.4, phase_s={"us": 300})
    assert w.bursts == (Burst(start_s=10, duration_s=5, rate_multiplier=4),)


@pytest.mark.parametrize(
    ("table", "fragment"),
    [
        ({"rate_sessions_per_s": 0}, "rate_sessions_per_s"),
        ({"arival": "poisson"}, "unknown field"),
        ({"arrival": "uniform"}, "arrival"),
        ({"mean_turns": 0.5}, "mean_turns"),
        ({"sources": []}, "sources must not be empty"),
        ({"models": [{"name": "m"}, {"name": "m"}]}, "unique"),
        ({"prompt_tokens": {"median": 10, "min": 20, "max": 10}}, "prompt_tokens"),
        ({"diurnal": {"amplitude": 1.0}}, "amplitude"),
        (
            {"max_context_tokens": 100, "tenants": [{"system_prompt_tokens": 90}]},
            "max_context_tokens",
        ),
    ],
)
def test_bad_tables_raise_a_specific_error(table, fragment):
    """Bad values and unknown keys raise WorkloadError naming the problem."""
    with pytest.raises(WorkloadError, match=fragment):
        ChatWorkload.from_dict(table)


def test_rate_multiplier_combines_diurnal_phase_and_bursts():
    """m_s(t) = (1 + A sin(2π(t − φ_s)/P)) × burst factor for the sources a burst names."""
    w = ChatWorkload(
        diurnal=Diurnal(period_s=100.0, amplitude=0.5, phase_s={"us": 25.0}),
        bursts=(Burst(start_s=40.0, duration_s=10.0, rate_multiplier=3.0, sources=("eu",)),),
    )
    assert w.rate_multiplier("eu", 25.0) == pytest.approx(1.5)
    assert w.rate_multiplier("us", 25.0) == pytest.approx(1.0)
    assert w.rate_multiplier("eu", 45.0) == pytest.approx(3.0 * (1 + 0.5 * 0.30901699437494734))
    assert w.rate_multiplier("us", 45.0) == pytest.approx(1 + 0.5 * 0.9510565162951535)


def test_lognormal_clips_and_rounds():
    """LogNormal.sample maps Z to round(median e^{σZ}) clipped to [min, max]."""
    ln = LogNormal(median=100.0, sigma=1.0, min=10, max=200)
    assert ln.sample(0.0) == 100
    assert ln.sample(5.0) == 200
    assert ln.sample(-5.0) == 10
