"""The data plane's request path (docs/design.md §3).

Request-path primitives:

* :mod:`~fastroute.proxy.path.requests` — minimal msgspec parse of OpenAI request bodies;
* :mod:`~fastroute.proxy.path.routing_key` — the session/conversation/prompt routing key;
* :mod:`~fastroute.proxy.path.admission` — the asyncio front end of the queue-delay guard.

The protection the proxy shares with the simulator (shedding, the queue-delay guard, the
retry budget, outlier ejection) is :mod:`fastroute.guards`. See ``docs/failure-handling.md``.
"""

__all__ = ["admission", "requests", "routing_key"]
