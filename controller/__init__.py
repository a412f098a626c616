"""fastroute control plane: collects signals, solves the routing LP, publishes weights.

Modules (the optimiser core; the service around it is issue 5's remaining work):

* :mod:`controller.latency` — TTFT/TBOT latency profiles and convex piecewise-linear costs;
* :mod:`controller.groups` — exact aggregation of engines into groups, capacity split;
* :mod:`controller.lp` / :mod:`controller.solve` — the deviation-form LP and its warm-started
  HiGHS solve (importing ``controller.solve`` imports highspy);
* :mod:`controller.weights` — weight rows, shed fractions, validation, churn.

Imports flow one way: ``controller`` may import ``fastroute.{tables,signals,config,errors,policy}``;
``fastroute`` never imports ``controller`` (the CLI imports it lazily).
"""

__all__: list[str] = []
