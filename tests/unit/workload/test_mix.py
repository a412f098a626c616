"""Bursty mixed trace replay: the burst time warp and the mix of trace windows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fastroute.workload import WorkloadError
from fastroute.workload.mix import ReplayComponent, ReplayMix, burst_warp, mixed_replay_sessions


def mix(tmp_path: Path, azure_csv, **kw) -> ReplayMix:
    a = azure_csv(tmp_path / "a.csv", 600, gap_s=0.5, prompt=300, out=20)
    b = azure_csv(tmp_path / "b.csv", 600, gap_s=0.25, prompt=900, out=5)
    params = {"rate_rps": 4.0, "burst_every_s": 20.0, "burst_s": 4.0, "burst_factor": 3.0}
    params.update(kw)
    return ReplayMix(
        components=(
            ReplayComponent(name="a", path=str(a), share=3.0, max_offset=50),
            ReplayComponent(name="b", path=str(b), share=1.0, max_offset=50),
        ),
        **params,
    )


def test_burst_warp_is_increasing_and_keeps_the_mean_rate():
    """One period of mean-rate time maps to one period of real time; inside it the
    burst part is compressed by the factor, the rest stretched."""
    u = np.linspace(0.0, 200.0, 4001)
    t = np.array([burst_warp(x, 20.0, 4.0, 3.0, 7.0) for x in u])
    assert np.all(np.diff(t) > 0)
    base = burst_warp(0.0, 20.0, 4.0, 3.0, 7.0)
    for k in range(1, 10):
        assert burst_warp(20.0 * k, 20.0, 4.0, 3.0, 7.0) - base == pytest.approx(20.0 * k)
    # Intensity: 12 s of mean-rate time fall in the 4-s burst (phase 0: burst first).
    assert burst_warp(12.0, 20.0, 4.0, 3.0, 0.0) == pytest.approx(4.0)
    assert burst_warp(5.0, 20.0, 0.0, 3.0, 0.0) == 5.0  # no bursts: identity


def test_mix_rate_shares_bursts_and_determinism(tmp_path: Path, azure_csv):
    """The mix has the requested rate and shares, 3x the mean rate inside bursts, and is a
    pure function of the seed (another seed: other windows)."""
    m = mix(tmp_path, azure_csv)
    s1 = mixed_replay_sessions(m, duration_s=100.0, sources=("eu",), seed=1)
    again = mixed_replay_sessions(m, duration_s=100.0, sources=("eu",), seed=1)
    other = mixed_replay_sessions(m, duration_s=100.0, sources=("eu",), seed=2)
    assert [(s.session_id, s.start_s) for s in s1] == [(s.session_id, s.start_s) for s in again]
    assert [s.session_id for s in s1] != [s.session_id for s in other]
    assert len(s1) == pytest.approx(400, rel=0.08)
    tenants = [s.tenant for s in s1]
    assert tenants.count("a") / len(tenants) == pytest.approx(0.75, abs=0.05)
    starts = np.array([s.start_s for s in s1])
    assert np.all(np.diff(starts) >= 0) and starts.min() >= 0 and starts.max() < 100
    # Bin arrivals by 1 s: the busiest 20 % of seconds carry ~3x the mean rate.
    counts = np.bincount(starts.astype(int), minlength=100)
    top = np.sort(counts)[-20:].mean()
    assert top / counts.mean() == pytest.approx(3.0, rel=0.25)
    assert {s.turns[0].max_tokens for s in s1} == {20, 5}


def test_mix_rejects_bad_parameters(tmp_path: Path, azure_csv):
    """Bursts that cannot keep the mean rate, an empty mix, or a missing file fail clearly."""
    with pytest.raises(WorkloadError, match="burst_factor \\* burst_s < burst_every_s"):
        mixed_replay_sessions(
            mix(tmp_path, azure_csv, burst_s=10.0), duration_s=10.0, sources=("eu",), seed=1
        )
    with pytest.raises(WorkloadError, match="at least one component"):
        ReplayMix(components=(), rate_rps=1.0).check()
    bad = ReplayMix(
        components=(ReplayComponent(name="x", path=str(tmp_path / "no.csv")),), rate_rps=1.0
    )
    with pytest.raises(WorkloadError, match="not found"):
        mixed_replay_sessions(bad, duration_s=10.0, sources=("eu",), seed=1)
