"""Write the Grafana dashboard ``fastroute.json`` from the panel list below (stdlib only).

Run ``python deploy/grafana/generate.py`` after editing; tests/unit/deploy/test_grafana_dashboard.py
checks the committed JSON is this script's output and that every metric it queries is one the
proxy, the controller or vLLM (the engines) exports. The datasource is the ``datasource``
template variable; ``$__rate_interval`` follows the scrape interval Grafana is told.
"""

# ruff: noqa: E501  (PromQL expressions read better unbroken)
from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).with_name("fastroute.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
RI = "$__rate_interval"

# fmt: off
#: (row title, [(panel title, unit, [(legend, expr), ...]), ...]); one row of panels per entry.
ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]] = [
    ("Traffic (proxy)", [
        ("Responses per engine", "reqps", [
            ("{{engine}}", f'sum by (engine) (rate(fastroute_proxy_requests_total{{engine!="none"}}[{RI}]))'),
        ]),
        ("Share of traffic per engine", "percentunit", [
            ("{{engine}}", f'sum by (engine) (rate(fastroute_proxy_requests_total{{engine!="none"}}[{RI}]))'
                           f' / scalar(sum(rate(fastroute_proxy_requests_total{{engine!="none"}}[{RI}])))'),
        ]),
        ("Responses by status", "reqps", [
            ("{{status}}", f"sum by (status) (rate(fastroute_proxy_requests_total[{RI}]))"),
        ]),
        ("In flight per proxy", "short", [
            ("{{instance}}", "sum by (instance) (fastroute_proxy_in_flight)"),
        ]),
    ]),
    ("Latency (proxy, client side)", [
        ("TTFT percentiles", "s", [
            (f"p{q}", f"histogram_quantile(0.{q}, sum by (le) (rate(fastroute_proxy_ttft_seconds_bucket[{RI}])))")
            for q in (50, 90, 99)
        ]),
        ("TTFT p99 per engine", "s", [
            ("{{engine}}", f"histogram_quantile(0.99, sum by (le, engine) (rate(fastroute_proxy_ttft_seconds_bucket[{RI}])))"),
        ]),
        ("TBOT percentiles", "s", [
            (f"p{q}", f"histogram_quantile(0.{q}, sum by (le) (rate(fastroute_proxy_tbot_seconds_bucket[{RI}])))")
            for q in (50, 90, 99)
        ]),
        ("End-to-end percentiles", "s", [
            (f"p{q}", f"histogram_quantile(0.{q}, sum by (le) (rate(fastroute_proxy_e2e_seconds_bucket[{RI}])))")
            for q in (50, 99)
        ]),
    ]),
    ("Prefix cache", [
        ("Prefix-cache hit rate per engine (proxy's window)", "percentunit", [
            ("{{engine}}", "max by (engine) (fastroute_proxy_engine_prefix_cache_hit_ratio)"),
        ]),
        ("Fleet prefix-cache hit rate", "percentunit", [
            ("proxy {{instance}}", "fastroute_proxy_prefix_cache_hit_ratio"),
            ("controller", "fastroute_controller_prefix_cache_hit_ratio"),
        ]),
    ]),
    ("Failures: retries, budget, ejections, derating", [
        ("Retries and budget refusals", "ops", [
            ("retries", f"sum(rate(fastroute_proxy_retries_total[{RI}]))"),
            ("refused by the retry budget", f"sum(rate(fastroute_proxy_retry_refused_total[{RI}]))"),
            ("broken streams {{outcome}}", f"sum by (outcome) (rate(fastroute_proxy_broken_streams_total[{RI}]))"),
        ]),
        ("Upstream failures", "ops", [
            ("{{engine}} {{kind}}", f"sum by (engine, kind) (rate(fastroute_proxy_upstream_failures_total[{RI}]))"),
        ]),
        ("Local ejections", "short", [
            ("{{engine}}", f"sum by (engine) (increase(fastroute_proxy_ejections_total[{RI}]))"),
        ]),
        ("Derating (controller health h)", "percentunit", [
            ("{{engine}}", "fastroute_controller_engine_health"),
        ]),
    ]),
    ("Admission and shedding", [
        ("429s per class and reason", "reqps", [
            ("{{class}} {{reason}}", f"sum by (class, reason) (rate(fastroute_proxy_shed_total[{RI}]))"),
        ]),
        ("Shed ratio per class (proxies)", "percentunit", [
            ("{{class}}", f"sum by (class) (rate(fastroute_proxy_shed_total[{RI}]))"
                          f" / sum by (class) (rate(fastroute_proxy_requests_total[{RI}]))"),
        ]),
        # fastroute_proxy_tenant_rejected_total comes with the tenant-limits change (allow-listed
        # in tests/unit/deploy/test_grafana_dashboard.py until it lands)
        ("429s per tenant and limit", "reqps", [
            ("{{tenant}} {{limit}}", f"sum by (tenant, limit) (rate(fastroute_proxy_tenant_rejected_total[{RI}]))"),
        ]),
        ("Planned shed fraction (controller)", "percentunit", [
            ("{{class}}", "fastroute_controller_shed_fraction"),
        ]),
        ("Capacity gain of prefix reuse (controller)", "short", [
            ("{{engine}}", "fastroute_controller_engine_reuse_gain"),
        ]),
        ("Demand forecast per class", "reqps", [
            ("{{class}}", "fastroute_controller_demand_rps"),
        ]),
    ]),
    ("Control plane", [
        ("Table age per proxy", "s", [
            ("{{instance}}", "fastroute_proxy_table_age_seconds"),
        ]),
        ("Table generation", "short", [
            ("proxy {{instance}}", "fastroute_proxy_table_generation"),
            ("controller", "fastroute_controller_table_generation"),
        ]),
        ("Plan solve time", "s", [
            (f"p{q}", f"histogram_quantile(0.{q}, sum by (le) (rate(fastroute_controller_solve_seconds_bucket[{RI}])))")
            for q in (50, 99)
        ]),
        ("Periods by solve status, and failed periods", "ops", [
            ("{{status}}", f"sum by (status) (rate(fastroute_controller_solves_total[{RI}]))"),
            ("failed: {{kind}}", f"sum by (kind) (rate(fastroute_controller_alerts_total[{RI}]))"),
        ]),
    ]),
    ("Engines (vLLM's /metrics)", [
        ("Requests running and waiting", "short", [
            ("running {{instance}}", "sum by (instance) (vllm:num_requests_running)"),
            ("waiting {{instance}}", "sum by (instance) (vllm:num_requests_waiting)"),
        ]),
        ("KV-cache usage", "percentunit", [
            ("{{instance}}", "max by (instance) (vllm:kv_cache_usage_perc)"),
        ]),
        ("Engine TTFT and inter-token latency p99", "s", [
            ("TTFT {{instance}}", f"histogram_quantile(0.99, sum by (le, instance) (rate(vllm:time_to_first_token_seconds_bucket[{RI}])))"),
            ("ITL {{instance}}", f"histogram_quantile(0.99, sum by (le, instance) (rate(vllm:inter_token_latency_seconds_bucket[{RI}])))"),
        ]),
        ("Engine prefix-cache hit rate and preemptions", "short", [
            ("hit rate {{instance}}", f"sum by (instance) (rate(vllm:prefix_cache_hits_total[{RI}]))"
                                      f" / sum by (instance) (rate(vllm:prefix_cache_queries_total[{RI}]))"),
            ("preemptions/s {{instance}}", f"sum by (instance) (rate(vllm:num_preemptions_total[{RI}]))"),
        ]),
    ]),
]
# fmt: on


def _panel(pid: int, title: str, unit: str, targets: list[tuple[str, str]], x: int, y: int) -> dict:
    return {
        "id": pid,
        "type": "timeseries",
        "title": title,
        "datasource": DS,
        "gridPos": {"h": 8, "w": 6, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend}
            for i, (legend, expr) in enumerate(targets)
        ],
    }


def dashboard() -> dict:
    """The dashboard as a dict (Grafana's JSON model, schema 39)."""
    panels: list[dict] = []
    y = 0
    for row_title, row in ROWS:
        panels.append(
            {
                "id": len(panels) + 1,
                "type": "row",
                "title": row_title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        y += 1
        for i, (title, unit, targets) in enumerate(row):
            panels.append(
                _panel(len(panels) + 1, title, unit, targets, 6 * (i % 4), y + 8 * (i // 4))
            )
        y += 8 * ((len(row) + 3) // 4)
    return {
        "uid": "fastroute",
        "title": "fastroute: proxy, controller, engines",
        "tags": ["fastroute"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                }
            ]
        },
        "panels": panels,
    }


def render() -> str:
    """The JSON text written to ``fastroute.json``."""
    return json.dumps(dashboard(), indent=1, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
