"""RejectBound: early rejections bounded by realised SLO attainment, with probes."""

from __future__ import annotations

import random

import pytest

from fastroute.predict.reject_bound import RejectBound, Verdict

#: Decisions in the long runs below (several windows).
LONG_RUN = 1000
#: A probe rate whose first probe comes after LONG_RUN decisions (isolates the bound).
RARE_PROBES = 1.0 / (2 * LONG_RUN)


def test_before_any_outcome_only_probes_get_through():
    """No evidence against the model yet: it is trusted, but every 20th request it
    rejects is probed (so outcomes start to arrive)."""
    bound = RejectBound(probe_rate=0.05, window=100)
    verdicts = [bound.verdict() for _ in range(LONG_RUN)]
    assert bound.miss_fraction == 1.0
    probes = [i for i, v in enumerate(verdicts) if v is Verdict.PROBE]
    assert probes[:3] == [19, 39, 59] and len(probes) == LONG_RUN // 20
    assert verdicts.count(Verdict.REJECT) == LONG_RUN - len(probes)


def test_one_met_outcome_lowers_the_bound_to_a_third():
    bound = RejectBound(probe_rate=RARE_PROBES, window=100)
    bound.observe(missed=False)
    verdicts = [bound.verdict() for _ in range(300)]
    assert bound.miss_fraction == pytest.approx(1 / 3)  # (0 + 1) / (1 + 2)
    assert verdicts[-100:].count(Verdict.REJECT) == 33
    assert set(verdicts) == {Verdict.REJECT, Verdict.ADMIT}


def test_a_fleet_meeting_its_slos_is_never_locked_out():
    """Every request predicted infeasible (a pessimistic model), every admitted one meets
    its SLO: the reject fraction falls to the bound's floor, 1 / (window + 2)."""
    bound = RejectBound(probe_rate=0.05, window=100)
    verdicts = []
    for _ in range(LONG_RUN):
        v = bound.verdict()
        verdicts.append(v)
        if v is not Verdict.REJECT:
            bound.observe(missed=False)
    tail = verdicts[-200:]
    assert tail.count(Verdict.REJECT) <= 2
    assert bound.reject_fraction <= bound.miss_fraction == pytest.approx(1 / 102)


def test_rejections_track_the_measured_shortfall():
    """Admitted requests miss 30 % of the time: no rejection takes the reject fraction
    above the measured miss fraction, and rejections do happen (the bound is not a wall)."""
    rng = random.Random(7)
    bound = RejectBound(probe_rate=RARE_PROBES, window=100)
    bound.observe(missed=False)  # past the cold start
    for _ in range(LONG_RUN):
        if bound.verdict() is Verdict.REJECT:
            # Holds when the rejection is made (a later hit may lower the shortfall).
            assert bound.reject_fraction <= bound.miss_fraction + 1e-12
        else:
            bound.observe(missed=rng.random() < 0.3)
    assert 0.15 < bound.reject_fraction < 0.45


def test_recovery_after_a_run_of_misses():
    """A stale window full of misses lets nearly every request be rejected; probes still
    get through, and once they meet their SLO the policy admits again (no absorbing
    state)."""
    bound = RejectBound(probe_rate=0.05, window=100)
    for _ in range(100):
        bound.observe(missed=True)
    for _ in range(100):
        bound.verdict()  # no outcome arrives for these (they were rejected, or in flight)
    assert bound.reject_fraction > 0.8
    admitted_after = None
    for i in range(LONG_RUN):
        if bound.verdict() is not Verdict.REJECT:
            bound.observe(missed=False)
            if admitted_after is None:
                admitted_after = i
    assert admitted_after is not None and admitted_after < 20  # the first probe
    assert bound.reject_fraction < 0.05


def test_probe_rate_is_the_admitted_share_when_rejection_is_justified():
    """Every admitted request misses (a real overload): only probes get through, at the
    probe rate."""
    bound = RejectBound(probe_rate=0.1, window=100)
    for _ in range(100):
        bound.observe(missed=True)
    verdicts = []
    for _ in range(LONG_RUN):
        v = bound.verdict()
        verdicts.append(v)
        if v is not Verdict.REJECT:
            bound.observe(missed=True)
    assert verdicts.count(Verdict.PROBE) == LONG_RUN // 10
    assert verdicts.count(Verdict.REJECT) / LONG_RUN > 0.85


def test_window_arithmetic_and_withdraw():
    bound = RejectBound(probe_rate=RARE_PROBES, window=4)
    bound.observe(missed=False)
    bound.observe(missed=True)  # shortfall (1 + 1) / (2 + 2) = 1/2
    assert bound.verdict() is Verdict.ADMIT  # would be 1 of 1 rejected
    assert bound.verdict() is Verdict.REJECT  # 1 of 2
    bound.withdraw()  # the caller routed it after all
    assert bound.reject_fraction == 0.0
    bound.admitted()
    bound.admitted()
    assert bound.verdict() is Verdict.REJECT  # 1 of 4
    assert bound.verdict() is Verdict.REJECT  # the oldest admission leaves: 2 of 4
    assert bound.verdict() is Verdict.ADMIT  # 3 of 4 would exceed 1/2
    bound.withdraw()  # the latest was an admission: nothing to forget
    assert bound.reject_fraction == pytest.approx(0.5)
    bound.observe(missed=True)
    assert bound.miss_fraction == pytest.approx(3 / 5)
    assert bound.to_dict()["outcomes"] == 3


def test_outcome_window_forgets_old_misses():
    bound = RejectBound(window=3)
    for missed in (True, True, True, False, False, False):
        bound.observe(missed)
    assert bound.outcomes == 3 and bound.miss_fraction == pytest.approx(1 / 5)


@pytest.mark.parametrize(("rate", "window"), [(0.0, 10), (-0.1, 10), (1.5, 10), (0.1, 0)])
def test_bad_arguments(rate, window):
    with pytest.raises(ValueError, match="probe_rate|window"):
        RejectBound(rate, window)
