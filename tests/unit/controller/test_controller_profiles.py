"""Online profile fitting: recovers a scaled curve from noisy windows, robust, bounded, convex."""

from __future__ import annotations

import numpy as np
import pytest

from controller.latency import LatencyProfile
from controller.profiles import ProfileFitter

SEED = LatencyProfile.seed(0.1, 0.01)


def _window(
    fitter: ProfileFitter,
    rho: np.ndarray,
    truth: list[LatencyProfile],
    rng: np.random.Generator,
    *,
    noise: float = 0.1,
    n: int = 50,
    exclude: np.ndarray | None = None,
) -> int:
    """One window: every engine at utilisation ``rho`` with latencies of its ``truth`` profile."""
    cap = fitter.capacity_rps
    ttft = np.array(
        [np.interp(r, t.breakpoints_rho, t.ttft_s) for r, t in zip(rho, truth, strict=True)]
    )
    tbot = np.array(
        [np.interp(r, t.breakpoints_rho, t.tbot_s) for r, t in zip(rho, truth, strict=True)]
    )
    ttft *= rng.lognormal(0.0, noise, rho.size)
    tbot *= rng.lognormal(0.0, noise, rho.size)
    count = np.full(rho.size, n)
    return fitter.observe(rho * cap, count, ttft * n, count, tbot * n, exclude=exclude)


def test_seed_is_returned_until_enough_samples() -> None:
    """No data (or thin windows) keep the configured hardware seed object itself."""
    f = ProfileFitter([SEED], [0, 0], [10.0, 10.0], min_weight=3.0)
    assert f.profile(0) is SEED
    count = np.array([2, 2])  # below min_latency_samples
    f.observe([5.0, 5.0], count, count * 0.2, count, count * 0.02)
    assert f.profile(0) is SEED and f.state()[0]["fitted"] is False


def test_fit_recovers_a_uniformly_slower_group_under_noise() -> None:
    """Engines 1.5× slower than the seed at every load: the fit converges to 1.5× within 5 %,
    including at breakpoints never observed (ratio interpolated / extended)."""
    truth = LatencyProfile(SEED.breakpoints_rho, SEED.ttft_s * 1.5, SEED.tbot_s * 1.5)
    f = ProfileFitter([SEED], np.zeros(6, int), np.full(6, 10.0), half_life_windows=20)
    rng = np.random.default_rng(1)
    for _ in range(60):
        rho = rng.uniform(0.1, 0.8, 6)
        assert _window(f, rho, [truth] * 6, rng) == 12
    fit = f.profile(0)
    assert fit is not SEED
    assert np.allclose(fit.ttft_s / SEED.ttft_s, 1.5, rtol=0.05)
    assert np.allclose(fit.tbot_s / SEED.tbot_s, 1.5, rtol=0.05)
    assert np.all(np.diff(fit.slopes_s) >= 0)


def test_fit_follows_a_different_shape_and_stays_convex() -> None:
    """A curve steeper than the seed at high load is learnt bin by bin; slopes stay convex."""
    b = SEED.breakpoints_rho
    truth = LatencyProfile(b, SEED.ttft_s * (1 + 2 * b**2), SEED.tbot_s)
    f = ProfileFitter([SEED], np.zeros(8, int), np.full(8, 10.0), half_life_windows=50)
    rng = np.random.default_rng(2)
    for _ in range(150):
        _window(f, rng.uniform(0.0, 0.95, 8), [truth] * 8, rng, noise=0.05)
    fit = f.profile(0)
    assert np.allclose(fit.ttft_s, truth.ttft_s, rtol=0.08)
    assert np.all(np.diff(fit.slopes_s) >= 0)
    assert np.all(np.diff(fit.ttft_s) >= 0)


def test_one_slow_member_does_not_move_its_group() -> None:
    """The per-window median over engines: one engine 3× slow in a group of five leaves the curve
    near the seed; excluded (derated) engines are not learnt from at all."""
    slow = LatencyProfile(SEED.breakpoints_rho, SEED.ttft_s * 3, SEED.tbot_s * 3)
    truth = [slow] + [SEED] * 4
    f = ProfileFitter([SEED], np.zeros(5, int), np.full(5, 10.0))
    rng = np.random.default_rng(3)
    for _ in range(40):
        _window(f, np.full(5, 0.5), truth, rng, noise=0.02)
    assert np.allclose(f.profile(0).ttft_s / SEED.ttft_s, 1.0, atol=0.05)
    g = ProfileFitter([SEED], np.zeros(2, int), np.full(2, 10.0))
    for _ in range(40):
        _window(g, np.full(2, 0.5), [slow, slow], rng, exclude=np.array([True, True]))
    assert g.profile(0) is SEED


def test_one_wild_window_moves_the_fit_a_bounded_amount() -> None:
    """After convergence one window 100× off moves a bin by at most clip × its weight share."""
    f = ProfileFitter([SEED], np.zeros(4, int), np.full(4, 10.0), clip_log=np.log(2.0))
    rng = np.random.default_rng(4)
    for _ in range(30):
        _window(f, np.full(4, 0.5), [SEED] * 4, rng, noise=0.01)
    before = f.profile(0).ttft_s.copy()
    wild = LatencyProfile(SEED.breakpoints_rho, SEED.ttft_s * 100, SEED.tbot_s)
    _window(f, np.full(4, 0.5), [wild] * 4, rng, noise=0.0)
    ratio = f.profile(0).ttft_s / before
    assert 1.0 < ratio.max() < 1.04  # unclipped, the 4.6 log step would move it ~18 %


def test_old_data_are_forgotten_and_memory_is_bounded() -> None:
    """With a half-life the fit tracks a drift; the state never grows with the number of windows."""
    fast = SEED
    slow = LatencyProfile(SEED.breakpoints_rho, SEED.ttft_s * 2, SEED.tbot_s * 2)
    f = ProfileFitter([SEED], np.zeros(3, int), np.full(3, 10.0), half_life_windows=5)
    rng = np.random.default_rng(5)
    sizes = []
    for truth in [fast] * 30 + [slow] * 60:
        _window(f, rng.uniform(0.2, 0.7, 3), [truth] * 3, rng, noise=0.05)
        sizes.append(sum(a.nbytes for a in (*f._w.values(), *f._s.values())))
    assert len(set(sizes)) == 1
    assert np.allclose(f.profile(0).ttft_s / SEED.ttft_s, 2.0, rtol=0.1)


def test_groups_are_fitted_independently_and_reported() -> None:
    """Two groups with different truths; ``state`` shows seed vs fitted and sample counts."""
    other = LatencyProfile.seed(0.05, 0.005)
    slow = LatencyProfile(SEED.breakpoints_rho, SEED.ttft_s * 1.3, SEED.tbot_s * 1.3)
    f = ProfileFitter([SEED, other], [0, 0, 1, 1], np.full(4, 10.0), group_names=["a", "b"])
    rng = np.random.default_rng(6)
    for _ in range(40):
        _window(f, rng.uniform(0.2, 0.8, 4), [slow, slow, other, other], rng, noise=0.02)
    st = f.state()
    assert [s["group"] for s in st] == ["a", "b"]
    assert st[0]["fitted"] and st[0]["engines"] == 2
    assert np.allclose(np.divide(st[0]["fitted_ttft_s"], st[0]["seed_ttft_s"]), 1.3, rtol=0.05)
    assert np.allclose(np.divide(st[1]["fitted_ttft_s"], st[1]["seed_ttft_s"]), 1.0, atol=0.05)
    assert sum(st[0]["ttft_samples"]) == 80


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"group_of_engine": [0, 2]}, "must lie in"),
        ({"capacity_rps": [1.0]}, "n_engines"),
        ({"half_life_windows": 0.0}, "> 0"),
    ],
)
def test_bad_arguments_are_rejected(kwargs: dict, match: str) -> None:
    """Out-of-range groups, shape mismatches and non-positive tunables raise ValueError."""
    args = {"group_of_engine": [0, 0], "capacity_rps": [1.0, 1.0], **kwargs}
    with pytest.raises(ValueError, match=match):
        ProfileFitter([SEED], **args)


def test_observe_rejects_wrong_shapes() -> None:
    """Signal arrays must have one entry per engine."""
    f = ProfileFitter([SEED], [0, 0], [1.0, 1.0])
    with pytest.raises(ValueError, match="shape"):
        f.observe([1.0], [1, 1], [1.0, 1.0], [1, 1], [1.0, 1.0])


def test_split_gives_an_engine_its_own_group_and_reseeds_a_lone_one() -> None:
    """A member split off gets a new group seeded as given (fitted separately from then on);
    splitting an engine that is already alone re-seeds its group instead of adding one."""
    f = ProfileFitter([SEED], np.zeros(3, int), np.full(3, 10.0), group_names=["hw"])
    slow = LatencyProfile(SEED.breakpoints_rho, SEED.ttft_s * 3, SEED.tbot_s * 3)
    g = f.split(0, slow, "hw+e0")
    assert g == 1 and f.n_groups == 2 and f.group_of_engine.tolist() == [1, 0, 0]
    assert f.profile(1) is slow and f.group_names == ("hw", "hw+e0")
    rng = np.random.default_rng(7)
    for _ in range(20):  # engine 0 is exactly its new seed; the others the old one
        _window(f, np.full(3, 0.5), [slow, SEED, SEED], rng, noise=0.01)
    assert np.allclose(f.profile(1).ttft_s / slow.ttft_s, 1.0, atol=0.03)
    assert np.allclose(f.profile(0).ttft_s / SEED.ttft_s, 1.0, atol=0.03)
    again = LatencyProfile(SEED.breakpoints_rho, SEED.ttft_s * 4, SEED.tbot_s * 4)
    assert f.split(0, again, "hw+e0") == 1 and f.n_groups == 2
    assert f.profile(1) is again and f.samples["ttft"][1].sum() == 0
