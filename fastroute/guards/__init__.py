"""Protection shared by the proxy and the simulator: pure state machines, clocks injected.

No I/O and no event loop: every call takes ``now_s`` (``loop.time()`` in the proxy,
virtual time in the simulator), so both run the same code.

* :mod:`~fastroute.guards.admission` — sticky per-session shedding (:func:`should_shed`)
  and the CoDel-style queue-delay guard (:class:`QueueDelayGuard`);
* :mod:`~fastroute.guards.retry_budget` — the Finagle-style retry budget
  (:class:`RetryBudget`);
* :mod:`~fastroute.guards.outlier` — fast local ejection on consecutive failures
  (:class:`OutlierDetector`, :class:`Outcome`).

See ``docs/failure-handling.md``.
"""

__all__ = ["admission", "outlier", "retry_budget"]
