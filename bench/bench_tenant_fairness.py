"""Fairness inside a priority: two tenants, weights 2 : 1, both demanding 2× the fleet.

The real controller (``ControllerService``: forecaster, HiGHS LP, tenant board, table
publisher on shared memory) is fed proxy reports in which tenants ``x`` (weight 2) and
``y`` (weight 1) each offer twice the fleet's capacity at priority ``default``; the LP
sheds the class, and the published ``meta["tenant_shed"]`` is then applied by the
proxies' own sticky shedding (``guards.admission.should_shed``) to a stream of distinct
routing keys per tenant. Printed: the LP's shed fraction, each tenant's published shed
fraction, the admitted counts and their ratio (acceptance: 2 : 1 within 5 %).

No HTTP: the proxies' side is the same function the request path calls, on random keys
(what distinct sessions/prompts hash to). Run: ``python bench/bench_tenant_fairness.py``
(a few seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import uuid

from controller.service import ControllerService
from fastroute.config import decode_config
from fastroute.guards.admission import should_shed
from fastroute.signals.reports import REPORT_VERSION, ClassDemand, Report, TenantDemand

CAPACITY_RPS = (10.0, 4.0, 4.0)


def _config(table: str) -> str:
    engines = "".join(
        f'[[engines]]\nname = "engine-{i}"\nurl = "http://127.0.0.1:{9 + i}"\n'
        f'models = ["demo-8b"]\nregion = "east"\ncapacity_rps = {cap}\n\n'
        for i, cap in enumerate(CAPACITY_RPS)
    )
    return (
        engines
        + '[[network.regions]]\nname = "east"\n\n'
        + "[controller]\nperiod_s = 1.0\nsolve_time_limit_s = 0.5\n\n"
        + f'[proxy]\ncluster = "east"\ntable_name = "{table}"\n\n'
        + '[[tenants]]\nname = "x"\napi_keys = ["kx"]\nweight = 2\n\n'
        + '[[tenants]]\nname = "y"\napi_keys = ["ky"]\nweight = 1\n'
    )


async def _run(args: argparse.Namespace) -> dict:
    now = [1_000_000.0]
    svc = ControllerService(
        decode_config(_config(f"fastroute-fairness-{uuid.uuid4().hex[:8]}"), source="bench"),
        clock=lambda: now[0],
    )
    fleet_rps = sum(CAPACITY_RPS)
    per_tenant_rps = args.demand_factor * fleet_rps
    cls = next(c for c in svc.model.classes if c.priority == "default")
    svc.open()
    try:
        for _ in range(args.periods):
            total = int(round(2 * per_tenant_rps))
            report = Report(
                REPORT_VERSION, "east", "bench:1", now[0], now[0] + 1.0,
                [ClassDemand(cls.key, requests=total)], [], proxy_id="bench:8080",
                tenants=[
                    TenantDemand("x", "default", int(per_tenant_rps)),
                    TenantDemand("y", "default", int(per_tenant_rps)),
                ],
            )  # fmt: skip
            svc.observe(report)
            now[0] += 1.0
            await svc.step()
        assert svc.plan is not None and svc.publisher.snapshot is not None
        sigma = float(svc.plan.shed_fraction[svc.model.classes.index(cls)])
        shed = svc.publisher.snapshot.meta.get("tenant_shed", {})
    finally:
        svc.close()
    rng = random.Random(args.seed)
    admitted = {}
    for tenant in ("x", "y"):
        f = float(shed.get(tenant, sigma))
        admitted[tenant] = sum(
            not should_shed(rng.getrandbits(64), f) for _ in range(args.requests)
        )
    ratio = admitted["x"] / max(1, admitted["y"])
    return {
        "fleet_capacity_rps": fleet_rps,
        "demand_rps_per_tenant": per_tenant_rps,
        "class_shed_fraction": sigma,
        "tenant_shed": shed,
        "requests_per_tenant": args.requests,
        "admitted": admitted,
        "admitted_ratio_x_to_y": ratio,
        "error_pct": 100.0 * (ratio - 2.0) / 2.0,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--periods", type=int, default=20)
    p.add_argument("--demand-factor", type=float, default=2.0)
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    result = asyncio.run(_run(args))
    print(json.dumps(result, indent=2))
    ok = abs(result["error_pct"]) <= 5.0
    verdict = "PASS" if ok else "MISS"
    print(f"admitted x:y = {result['admitted_ratio_x_to_y']:.3f} (2 ± 5 %): {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
