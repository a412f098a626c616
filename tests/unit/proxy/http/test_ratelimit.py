"""OpenAI's x-ratelimit headers and reset duration strings."""

from __future__ import annotations

import pytest

from fastroute.proxy.http.ratelimit import RateLimitState, duration_string, ratelimit_headers


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0ms"), (0.0201, "21ms"), (1, "1s"), (1.5, "1.5s"), (360, "6m0s"), (3723, "1h2m3s")],
)
def test_duration_strings_follow_openai(seconds: float, text: str) -> None:
    assert duration_string(seconds) == text


def test_bad_durations_are_refused() -> None:
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="finite and >= 0"):
            duration_string(bad)


def test_headers_carry_only_the_limits_set() -> None:
    both = ratelimit_headers(RateLimitState(600, 12, 90000, -5, 6.0))
    assert both == {
        "x-ratelimit-limit-requests": "600",
        "x-ratelimit-remaining-requests": "12",
        "x-ratelimit-reset-requests": "6s",
        "x-ratelimit-limit-tokens": "90000",
        "x-ratelimit-remaining-tokens": "0",  # an overuse corrected later never goes negative
        "x-ratelimit-reset-tokens": "6s",
    }
    only_tokens = ratelimit_headers(RateLimitState(None, None, 100, 40, 0.5))
    assert set(only_tokens) == {
        "x-ratelimit-limit-tokens",
        "x-ratelimit-remaining-tokens",
        "x-ratelimit-reset-tokens",
    }
