"""The per-request record every latency metric is computed from (docs/metrics.md).

One :class:`RequestRecord` per *request* (a user turn), not per attempt: retries are
counted in ``attempts``. The simulator fills them in virtual time; the emulated-fleet
benchmark fills them from its HTTP client's wall clock. Times are client-side: when
the client sent the request, received the first token, and received the last token
(or the error). :func:`fastroute.sim.metrics.summarize` turns a list of them into the
metrics of docs/metrics.md.
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ["RequestRecord", "Outcome", "OUTCOMES"]

#: How a request ended: served, refused by admission (shed), or failed after its attempts.
Outcome = Literal["ok", "shed", "failed"]
OUTCOMES: tuple[str, ...] = ("ok", "shed", "failed")


class RequestRecord(msgspec.Struct, kw_only=True):
    """One request as the client saw it.

    Attributes
    ----------
    request_id : str
        Unique id.
    session_id : str
        Conversation id (affinity loss compares consecutive requests of a session).
    turn : int
        0-based turn of the session.
    cls : str
        Request class label (the simulator uses ``"{source}/{model}"``).
    source : str
        Source region of the client.
    model : str
        Requested model.
    tenant : str
        Tenant.
    arrival_s : float
        When the client sent the request.
    first_token_s : float or None
        When the client received the first token (None unless ``outcome == "ok"``).
    finish_s : float or None
        When the client received the last token or the final error (None if shed
        before any attempt).
    prompt_tokens : int
        Prompt length in tokens.
    output_tokens : int
        Tokens received (0 unless ``ok``).
    cached_tokens : int
        Prompt tokens served from the engine's prefix cache (last attempt); -1 if unknown.
    outcome : {"ok", "shed", "failed"}
        How the request ended.
    reason : str
        Why it was shed or failed (``"shed-fraction"``, ``"queue-delay"``,
        ``"no-engine"``, ``"http-5xx"``, ``"connect-error"``, ...); empty when ok.
    attempts : int
        Upstream attempts (0 when shed before the first).
    engine : str
        Engine of the last attempt (empty if none).
    preemptions : int
        Times the engine preempted the request (recompute); -1 if unknown.
    migrations : int
        Mid-stream migrations: the stream broke after its first token and went on on
        another engine (``dataplane.max_migrations``).
    migrated_tokens : int
        Output tokens the continuations prefilled again (their cost), summed.
    hedged : bool
        A hedge was sent (``dataplane.hedge``; the fleet benchmark leaves it False).
    hedge_won : bool
        The hedge's attempt produced the first token.
    hedge_prefill_tokens : int
        Prompt tokens the cancelled attempt of a hedged request had prefilled (the
        hedge's cost).
    """

    request_id: str
    session_id: str = ""
    turn: int = 0
    cls: str = ""
    source: str = ""
    model: str = ""
    tenant: str = ""
    arrival_s: float
    first_token_s: float | None = None
    finish_s: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = -1
    outcome: Outcome = "ok"
    reason: str = ""
    attempts: int = 1
    engine: str = ""
    preemptions: int = -1
    migrations: int = 0
    migrated_tokens: int = 0
    hedged: bool = False
    hedge_won: bool = False
    hedge_prefill_tokens: int = 0

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, or None."""
        if self.first_token_s is None:
            return None
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        """End-to-end latency of a served request, or None."""
        if self.outcome != "ok" or self.finish_s is None:
            return None
        return self.finish_s - self.arrival_s

    @property
    def tbot_s(self) -> float | None:
        """Mean time between output tokens after the first, or None (one token or not ok)."""
        if self.outcome != "ok" or self.output_tokens < 2 or self.first_token_s is None:
            return None
        assert self.finish_s is not None
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)
