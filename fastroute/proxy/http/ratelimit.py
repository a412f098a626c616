"""OpenAI's rate-limit response headers: ``x-ratelimit-*`` and the reset duration format.

OpenAI answers every request with ``x-ratelimit-limit-requests``,
``x-ratelimit-remaining-requests``, ``x-ratelimit-reset-requests`` and the ``-tokens``
triple; the reset is a Go-style duration (``1s``, ``6m0s``, ``20ms``). Clients (the
``openai`` SDKs, LangChain, LiteLLM) read them to pace themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["RateLimitState", "duration_string", "ratelimit_headers"]


def duration_string(seconds: float) -> str:
    """Format ``seconds`` as OpenAI's reset duration: ``20ms``, ``1.5s``, ``6m0s``, ``1h2m3s``.

    Raises
    ------
    ValueError
        Negative or non-finite ``seconds``.
    """
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"a reset duration must be finite and >= 0, got {seconds!r}")
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    secs_text = f"{secs:.3f}".rstrip("0").rstrip(".")
    if hours >= 1:
        return f"{int(hours)}h{int(minutes)}m{secs_text}s"
    if minutes >= 1:
        return f"{int(minutes)}m{secs_text}s"
    return f"{secs_text}s"


@dataclass(frozen=True, slots=True)
class RateLimitState:
    """One tenant's limits as seen by this proxy, for the headers.

    Attributes
    ----------
    limit_requests, remaining_requests : int, optional
        Per-minute request share and what is left of it (None: no request limit).
    limit_tokens, remaining_tokens : int, optional
        Per-minute token share and what is left of it (None: no token limit).
    reset_s : float
        Seconds until the oldest counted sub-window leaves the minute.
    """

    limit_requests: int | None
    remaining_requests: int | None
    limit_tokens: int | None
    remaining_tokens: int | None
    reset_s: float


def ratelimit_headers(state: RateLimitState) -> dict[str, str]:
    """The ``x-ratelimit-*`` headers of ``state`` (only the limits that are set)."""
    reset = duration_string(state.reset_s)
    headers: dict[str, str] = {}
    if state.limit_requests is not None:
        headers["x-ratelimit-limit-requests"] = str(state.limit_requests)
        headers["x-ratelimit-remaining-requests"] = str(max(0, state.remaining_requests or 0))
        headers["x-ratelimit-reset-requests"] = reset
    if state.limit_tokens is not None:
        headers["x-ratelimit-limit-tokens"] = str(state.limit_tokens)
        headers["x-ratelimit-remaining-tokens"] = str(max(0, state.remaining_tokens or 0))
        headers["x-ratelimit-reset-tokens"] = reset
    return headers
