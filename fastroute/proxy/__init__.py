"""The data plane's request path (DESIGN.md §3).

Pure request-path primitives, no I/O, clocks injected, shared by the live proxy and
the simulator:

* :mod:`~fastroute.proxy.requests` — minimal msgspec parse of OpenAI request bodies;
* :mod:`~fastroute.proxy.routing_key` — the session/conversation/prompt routing key;
* :mod:`~fastroute.proxy.admission` — sticky shedding and the queue-delay guard;
* :mod:`~fastroute.proxy.retry_budget` — the Finagle-style retry budget;
* :mod:`~fastroute.proxy.outlier` — fast local ejection on consecutive failures.

See ``docs/failure-handling.md``.
"""

__all__ = ["admission", "outlier", "requests", "retry_budget", "routing_key"]
