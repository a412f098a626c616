"""Per-request latency objectives from request headers (``marginal-cost`` classes only).

=================================  ================================================
header                             meaning
=================================  ================================================
``x-fastroute-ttft-slo-ms``        time-to-first-token objective, milliseconds
``x-fastroute-tpot-slo-ms``        time-per-output-token objective, milliseconds
=================================  ================================================

Each is a number in [:data:`MIN_SLO_MS`, :data:`MAX_SLO_MS`] (decimals allowed);
anything else is a 400 naming the header. A missing header means the class default
(``classes[].ttft_slo_s`` / ``tbot_slo_s``). Only classes whose policy is
``marginal-cost`` read them (other policies have no use for an SLO at routing time);
like every ``x-fastroute-*`` header they are never forwarded to the engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = ["TTFT_SLO_HEADER", "TPOT_SLO_HEADER", "MIN_SLO_MS", "MAX_SLO_MS", "request_slos"]

TTFT_SLO_HEADER = "x-fastroute-ttft-slo-ms"
TPOT_SLO_HEADER = "x-fastroute-tpot-slo-ms"
#: Smallest objective accepted, milliseconds.
MIN_SLO_MS = 1.0
#: Largest objective accepted, milliseconds (ten minutes).
MAX_SLO_MS = 600_000.0


def _header_s(headers: Mapping[str, str], name: str, default_s: float) -> float:
    raw = headers.get(name)
    if raw is None:
        return default_s
    try:
        ms = float(raw.strip())
    except ValueError:
        ms = math.nan
    if not MIN_SLO_MS <= ms <= MAX_SLO_MS:  # also rejects NaN
        raise ValueError(
            f"Header {name} must be a number of milliseconds in "
            f"[{MIN_SLO_MS:g}, {MAX_SLO_MS:g}]; got {raw[:32]!r}."
        )
    return ms / 1000.0


def request_slos(
    headers: Mapping[str, str], ttft_default_s: float, tpot_default_s: float
) -> tuple[float, float]:
    """``(ttft_s, tpot_s)`` of a request: its headers, else the class defaults.

    Raises
    ------
    ValueError
        A header is not a number of milliseconds within the bounds (the message
        names the header and is meant for the client).
    """
    return (
        _header_s(headers, TTFT_SLO_HEADER, ttft_default_s),
        _header_s(headers, TPOT_SLO_HEADER, tpot_default_s),
    )
