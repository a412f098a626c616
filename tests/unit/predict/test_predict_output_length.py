"""Output-length histograms: exact means, quantiles, back-off, decay, remaining length."""

from __future__ import annotations

import numpy as np
import pytest

from fastroute.predict import OutputLengthPredictor


def test_prior_before_any_data():
    """Nothing observed: the prior mean, and prior minus generated for the remainder."""
    p = OutputLengthPredictor(prior_tokens=300)
    assert p.mean("t", "c") == 300
    assert p.quantile(0.5) == 300
    assert p.remaining(100, "t", "c") == 200


def test_mean_is_exact_and_quantiles_land_in_the_right_bucket(rand):
    """Token sums are kept, so the mean is the sample mean; the median is within one bucket."""
    p = OutputLengthPredictor(min_samples=1)
    samples = [max(1, int(rand.lognormvariate(5.3, 0.9))) for _ in range(3000)]
    for s in samples:
        p.observe(s, 0.0, cls="chat")
    assert p.mean(cls="chat") == pytest.approx(np.mean(samples), rel=1e-9)
    assert p.quantile(0.5, cls="chat") == pytest.approx(np.median(samples), rel=0.2)
    assert p.quantile(0.9, cls="chat") == pytest.approx(np.quantile(samples, 0.9), rel=0.2)
    with pytest.raises(ValueError, match="q must be"):
        p.quantile(1.5)


def test_back_off_to_class_then_global_until_a_key_has_enough_samples():
    """A tenant with fewer than min_samples uses its class; an unseen class uses global."""
    p = OutputLengthPredictor(min_samples=50)
    for _ in range(200):
        p.observe(100, 0.0, tenant="other", cls="chat")
    for _ in range(10):
        p.observe(1000, 0.0, tenant="big", cls="chat")
    class_mean = (200 * 100 + 10 * 1000) / 210
    assert p.histogram_key("big", "chat") == ("chat",)
    assert p.mean("big", "chat") == pytest.approx(class_mean)
    assert p.mean("nobody", "batch") == pytest.approx(class_mean)  # global
    for _ in range(40):
        p.observe(1000, 0.0, tenant="big", cls="chat")
    assert p.histogram_key("big", "chat") == ("big", "chat")
    assert p.mean("big", "chat") == pytest.approx(1000)
    assert p.count("big", "chat") == pytest.approx(50)


def test_decay_follows_a_changing_workload():
    """Four half-lives later, old samples weigh 1/16: the mean moves to the new lengths."""
    half = 600.0
    p = OutputLengthPredictor(half_life_s=half, min_samples=1)
    for _ in range(200):
        p.observe(100, 0.0, cls="c")
    for _ in range(200):
        p.observe(1000, 4 * half, cls="c")
    expected = (200 / 16 * 100 + 200 * 1000) / (200 / 16 + 200)
    assert p.mean(cls="c") == pytest.approx(expected, rel=1e-9)
    assert p.count(cls="c") == pytest.approx(200 / 16 + 200)
    # Querying later with a clock decays the counts (not the mean: all samples age alike).
    assert p.mean(cls="c", now_s=8 * half) == pytest.approx(expected, rel=1e-9)
    assert p.count(cls="c") == pytest.approx((200 / 16 + 200) / 16)


def test_decay_lets_a_stale_key_back_off():
    """A key whose samples decayed below min_samples yields to its parent again."""
    p = OutputLengthPredictor(half_life_s=100.0, min_samples=50)
    for _ in range(60):
        p.observe(1000, 0.0, tenant="t", cls="c")
    for _ in range(500):
        p.observe(10, 1000.0, tenant="u", cls="c")
    assert p.histogram_key("t", "c") == ("t", "c")
    assert p.histogram_key("t", "c", now_s=1000.0) == ("c",)


def test_remaining_length_of_a_running_request(rand):
    """E[N - g | N > g] matches the empirical conditional mean of the samples."""
    p = OutputLengthPredictor(min_samples=1, buckets_per_octave=8)
    samples = np.array([max(1, int(rand.lognormvariate(5.0, 1.0))) for _ in range(5000)])
    for s in samples:
        p.observe(int(s), 0.0)
    assert p.remaining(0) == pytest.approx(samples.mean())
    for g in (50, 150, 400):
        tail = samples[samples > g]
        assert p.remaining(g) == pytest.approx(tail.mean() - g, rel=0.12), g
    beyond = int(samples.max()) + 10
    assert p.remaining(beyond) >= 1.0


def test_keys_are_bounded():
    """At most max_keys (tenant, class) histograms; the least recently observed goes first."""
    p = OutputLengthPredictor(max_keys=3, min_samples=1)
    for i in range(5):
        p.observe(10 * (i + 1), 0.0, tenant=f"t{i}", cls="c")
    assert p.count("t0", "c") == 0 and p.count("t1", "c") == 0
    assert p.count("t4", "c") == 1 and p.mean("t4", "c") == 50


def test_bad_observations_are_rejected():
    p = OutputLengthPredictor()
    with pytest.raises(ValueError, match="at least one token"):
        p.observe(0, 0.0)
    with pytest.raises(ValueError, match="finite"):
        p.observe(5, float("nan"))
