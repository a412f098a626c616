"""HTTP load driver: play multi-turn chat sessions against OpenAI-compatible servers.

* :mod:`~fastroute.loadgen.driver` — :class:`LoadDriver` (open or closed loop, bounded);
* :mod:`~fastroute.loadgen.client` — one timed chat request (SSE or JSON);
* :mod:`~fastroute.loadgen.records` — :class:`RequestRecord`, one per request;
* :mod:`~fastroute.loadgen.summary` — percentiles, per-engine shares, goodput.

The sessions come from :mod:`fastroute.workload` (the simulator, the demo and the
fleet benchmark share that code). aiohttp is imported with this package.
"""

from fastroute.loadgen.driver import DriveOptions, DriveResult, LoadDriver
from fastroute.loadgen.records import ERROR_KINDS, RequestRecord
from fastroute.loadgen.summary import RunSummary, percentile, summarize

__all__ = [
    "DriveOptions",
    "DriveResult",
    "ERROR_KINDS",
    "LoadDriver",
    "RequestRecord",
    "RunSummary",
    "percentile",
    "summarize",
]
