"""What the load driver records per request, and the error kinds it distinguishes.

One :class:`RequestRecord` per request the driver sent (or abandoned at the
deadline). Times are client-side, measured with :func:`time.perf_counter`:

* ``ttft_s``: request written → first output token received (streaming only; a
  non-streaming response has no first token, so it is None);
* ``tbot_s``: mean gap between consecutive output tokens of the response (what vLLM
  calls time per output token); ``max_gap_s`` the longest such gap;
* ``e2e_s``: request written → response complete.

``error`` is None for a complete 200 response, else one of :data:`ERROR_KINDS`
(``http_<status>`` for an error status). ``error_code`` is the ``code`` of an error
status's body when it has one (OpenAI's and SGLang's shapes), so a report can tell the
proxy's reasons for a 429 apart: ``load_shed`` (the controller's shed fraction),
``overloaded`` (the queue-delay guard), ``slo_infeasible`` (early rejection),
``rate_limit_exceeded`` (a tenant limit), ``engines_at_capacity``; an engine's own
429 carries its integer code (``"429"`` from vLLM).
"""

from __future__ import annotations

import msgspec

__all__ = ["RequestRecord", "ERROR_KINDS"]

#: Error kinds besides ``http_<status>``.
ERROR_KINDS = (
    "connect",  # TCP connect failed or refused
    "timeout",  # the per-request timeout expired
    "disconnected",  # the server closed the connection before the response was complete
    "stream_error",  # an SSE ``error`` event (e.g. the proxy's mid-stream failure event)
    "bad_response",  # a 200 whose body could not be parsed
    "deadline",  # still in flight when the run's drain period ended; cancelled
)


class RequestRecord(msgspec.Struct, kw_only=True):
    """One request as the client saw it.

    Attributes
    ----------
    session_id, tenant, source, model : str
        From the session; ``source`` is the source cluster the request was sent from.
    turn : int
        Index of the turn in its session (0 = first).
    sent_at_s : float
        When the request was written, seconds since the run started.
    queued_s : float
        Time the request waited for an in-flight slot before it was sent.
    stream : bool
        Whether the request asked for SSE streaming.
    status : int
        HTTP status; 0 when no response arrived.
    error : str or None
        None for success, else an error kind (see the module doc).
    error_code : str or None
        The error body's ``code`` of a non-200 reply, as a string; None when the reply
        was 200 or its body had none.
    engine : str or None
        The ``x-fastroute-engine`` response header (engines and fastroute set it).
    route_reason : str or None
        The ``reason`` field of fastroute's ``x-fastroute-decision`` header (why the
        policy chose that engine: ``prefix-home``, ``cost-spill``, ...); None from a
        router that does not send it.
    ttft_s, tbot_s, max_gap_s, e2e_s : float or None
        Client-side latencies, seconds (see the module doc).
    output_tokens : int
        Output tokens received (content or reasoning chunks when streaming, ``usage``
        otherwise).
    prompt_tokens, cached_tokens : int or None
        From the response's ``usage`` when present (``prompt_tokens_details``).
    """

    session_id: str
    tenant: str
    source: str
    model: str
    turn: int
    sent_at_s: float
    queued_s: float = 0.0
    stream: bool = True
    status: int = 0
    error: str | None = None
    error_code: str | None = None
    engine: str | None = None
    route_reason: str | None = None
    ttft_s: float | None = None
    tbot_s: float | None = None
    max_gap_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None

    @property
    def ok(self) -> bool:
        """True for a complete successful response."""
        return self.error is None
