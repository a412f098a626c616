"""fastroute control plane: collects signals, solves the routing LP, publishes weights.

Modules:

* :mod:`controller.latency` — TTFT/TBOT latency profiles and convex piecewise-linear costs;
* :mod:`controller.groups` — exact aggregation of engines into groups, capacity split;
* :mod:`controller.lp` / :mod:`controller.solve` — the deviation-form LP and its warm-started
  HiGHS solve (importing ``controller.solve`` imports highspy);
* :mod:`controller.weights` — weight rows, shed fractions, validation, churn;
* :mod:`controller.demand` — per-class demand forecast from the proxies' reports;
* :mod:`controller.model` — demand classes, the static LP data from the config, a plan;
* :mod:`controller.learning` — derating levels and fitted profiles: the model as learnt;
* :mod:`controller.planner` — one period's plan: the LP or the p-controller baseline;
* :mod:`controller.publish` — the shared-memory table, the snapshot in force, its long-poll;
* :mod:`controller.explain` — the plan as JSON (``/v1/plan``; :mod:`controller.plan_page`
  renders it as HTML);
* :mod:`controller.service` / :mod:`controller.app` / :mod:`controller.cli` — the control
  loop (options: :mod:`controller.options`, metrics: :mod:`controller.metrics`), its HTTP API
  (``/v1/table`` long-poll, ``/v1/reports``, ``/v1/plan``) and ``fastroute controller``.

Imports flow one way: ``controller`` may import ``fastroute.{tables,signals,config,errors,policy}``;
``fastroute`` never imports ``controller`` (the CLI imports it lazily).
"""

__all__: list[str] = []
