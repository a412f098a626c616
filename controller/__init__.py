"""fastroute control plane: collects signals, solves the routing LP, publishes weights.

Modules:

* :mod:`controller.latency` — TTFT/TBOT latency profiles and convex piecewise-linear costs;
* :mod:`controller.groups` — exact aggregation of engines into groups, capacity split;
* :mod:`controller.lp` / :mod:`controller.solve` — the deviation-form LP and its warm-started
  HiGHS solve (importing ``controller.solve`` imports highspy);
* :mod:`controller.weights` — weight rows, shed fractions, validation, churn;
* :mod:`controller.demand` — per-class demand forecast from the proxies' reports;
* :mod:`controller.service` / :mod:`controller.app` / :mod:`controller.cli` — the control
  loop, its HTTP API (``/v1/table`` long-poll, ``/v1/reports``, ``/v1/plan``) and
  ``fastroute controller``.

Imports flow one way: ``controller`` may import ``fastroute.{tables,signals,config,errors,policy}``;
``fastroute`` never imports ``controller`` (the CLI imports it lazily).
"""

__all__: list[str] = []
