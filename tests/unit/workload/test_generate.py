"""generate_sessions: determinism, shapes, prefix sharing and arrival rates."""

from __future__ import annotations

import statistics

import pytest

from fastroute.tokens import count_text_tokens, render_chat
from fastroute.workload import (
    Burst,
    ChatWorkload,
    Diurnal,
    TenantMix,
    Weighted,
    WorkloadError,
    generate_sessions,
)
from fastroute.workload.session import reply_text

W = ChatWorkload(
    rate_sessions_per_s=4.0,
    mean_turns=3.0,
    tenants=(
        TenantMix(name="a", system_prompt_tokens=100),
        TenantMix(name="b", system_prompt_tokens=300),
    ),
    sources=(Weighted(name="eu"), Weighted(name="us", weight=3.0)),
    models=(Weighted(name="m1"), Weighted(name="m2")),
)


def test_same_seed_same_sessions_other_seed_different():
    """Equal seeds give equal sessions; a different seed gives different ones."""
    a = generate_sessions(W, duration_s=60.0, seed=7)
    b = generate_sessions(W, duration_s=60.0, seed=7)
    c = generate_sessions(W, duration_s=60.0, seed=8)
    assert a == b
    assert [s.start_s for s in a] != [s.start_s for s in c]


def test_sessions_sorted_with_unique_ids_and_valid_turns():
    """Sorted by start, unique ids, every turn's text has its stated token count."""
    sessions = generate_sessions(W, duration_s=60.0, seed=1)
    assert [s.start_s for s in sessions] == sorted(s.start_s for s in sessions)
    assert len({s.session_id for s in sessions}) == len(sessions)
    for s in sessions:
        assert s.turns and s.turns[0].think_s == 0.0
        for t in s.turns:
            assert count_text_tokens(t.user_text) == t.user_tokens and t.max_tokens >= 1


def test_tenant_system_prompt_shared_first_user_messages_differ():
    """A tenant's system prompt is byte-identical in all its sessions; first user texts differ."""
    sessions = generate_sessions(W, duration_s=60.0, seed=2)
    by_tenant: dict[str, set[str]] = {}
    for s in sessions:
        by_tenant.setdefault(s.tenant, set()).add(s.system_prompt)
    assert set(by_tenant) == {"a", "b"} and all(len(v) == 1 for v in by_tenant.values())
    assert count_text_tokens(next(iter(by_tenant["b"]))) == 300
    firsts = [s.turns[0].user_text for s in sessions]
    assert len(set(firsts)) == len(firsts)


def test_rates_turns_and_source_split_follow_the_workload():
    """Session count ≈ rate × duration, the source split ≈ weights, mean turns ≈ mean_turns."""
    w = ChatWorkload(
        rate_sessions_per_s=20.0,
        mean_turns=3.0,
        max_context_tokens=1_000_000,
        sources=(Weighted(name="eu"), Weighted(name="us", weight=3.0)),
    )
    sessions = generate_sessions(w, duration_s=200.0, seed=4)
    assert len(sessions) == pytest.approx(4000, rel=0.06)
    us = sum(s.source == "us" for s in sessions) / len(sessions)
    assert us == pytest.approx(0.75, abs=0.03)
    assert statistics.fmean(len(s.turns) for s in sessions) == pytest.approx(3.0, rel=0.06)


def test_gamma_arrivals_are_burstier_than_poisson():
    """Gamma arrivals with CV 3 have inter-arrival CV ≈ 3, Poisson ≈ 1."""

    def cv(workload: ChatWorkload) -> float:
        starts = [s.start_s for s in generate_sessions(workload, duration_s=400.0, seed=5)]
        gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
        return statistics.pstdev(gaps) / statistics.fmean(gaps)

    assert cv(ChatWorkload(rate_sessions_per_s=20.0)) == pytest.approx(1.0, abs=0.1)
    assert cv(
        ChatWorkload(rate_sessions_per_s=20.0, arrival="gamma", arrival_cv=3.0)
    ) == pytest.approx(3.0, rel=0.2)


def test_diurnal_and_burst_shape_the_rate():
    """Rate follows the cycle (peak vs trough ≈ (1+A)/(1−A)) and a burst multiplies it."""
    w = ChatWorkload(rate_sessions_per_s=20.0, diurnal=Diurnal(period_s=400.0, amplitude=0.6))
    starts = [s.start_s for s in generate_sessions(w, duration_s=400.0, seed=6)]
    peak = sum(50 <= t < 150 for t in starts)
    trough = sum(250 <= t < 350 for t in starts)
    assert 2.5 < peak / trough < 6.5  # expected ≈ 3.3 (averaged over the quarter)
    b = ChatWorkload(
        rate_sessions_per_s=20.0,
        bursts=(Burst(start_s=100.0, duration_s=50.0, rate_multiplier=4.0),),
    )
    starts = [s.start_s for s in generate_sessions(b, duration_s=200.0, seed=6)]
    inside = sum(100 <= t < 150 for t in starts)
    before = sum(0 <= t < 50 for t in starts)
    assert 3.0 < inside / before < 5.3


def test_context_stays_under_max_context_tokens():
    """Every turn's rendered prompt + max_tokens fits max_context_tokens (replies at their cap)."""
    w = ChatWorkload(rate_sessions_per_s=5.0, mean_turns=20.0, max_context_tokens=3000)
    sessions = generate_sessions(w, duration_s=30.0, seed=9)
    assert max(len(s.turns) for s in sessions) < 20  # sessions were cut
    for s in sessions[:20]:
        replies = []
        for i, t in enumerate(s.turns):
            prompt = count_text_tokens(render_chat(s.messages(i, replies)))
            assert prompt + t.max_tokens <= 3000
            replies.append(reply_text(s.session_id, i, t.max_tokens))


def test_bad_duration_is_rejected():
    """duration_s must be positive."""
    with pytest.raises(WorkloadError, match="duration_s"):
        generate_sessions(W, duration_s=0.0, seed=1)
