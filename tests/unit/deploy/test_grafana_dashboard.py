"""deploy/grafana: the committed dashboard is the generator's output, its datasource is a
variable, and every metric the dashboard and the Prometheus rules read is one that a live proxy,
controller or vLLM engine exports."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from metric_names import exported_names, promql_metric_names, vllm_names
from promtool import ROOT, RULES

GRAFANA = ROOT / "deploy" / "grafana"

#: Metrics another change adds, allowed before they land (none now: the tenant-limits change
#: that added ``fastroute_proxy_tenant_rejected_total`` is merged). Drop a name once its
#: change is merged.
ADDED_BY_OTHER_CHANGES: frozenset[str] = frozenset()


def _generator() -> Any:
    spec = importlib.util.spec_from_file_location("grafana_generate", GRAFANA / "generate.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _dashboard() -> dict[str, Any]:
    return json.loads((GRAFANA / "fastroute.json").read_text())


def _dashboard_exprs() -> Iterator[str]:
    for p in _dashboard()["panels"]:
        for t in p.get("targets", []):
            yield t["expr"]


def _rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    return exported_names()


def test_committed_json_is_the_generators_output() -> None:
    assert (GRAFANA / "fastroute.json").read_text() == _generator().render(), (
        "deploy/grafana/fastroute.json is stale: run python deploy/grafana/generate.py"
    )


def test_datasource_is_a_template_variable() -> None:
    d = _dashboard()
    assert [v["type"] for v in d["templating"]["list"]] == ["datasource"]
    panels = [p for p in d["panels"] if p["type"] != "row"]
    assert panels and all(p["datasource"]["uid"] == "${datasource}" for p in panels)
    assert len({p["id"] for p in d["panels"]}) == len(d["panels"])


def test_dashboard_covers_the_briefed_signals() -> None:
    used = set().union(*map(promql_metric_names, _dashboard_exprs()))
    for name in (
        "fastroute_proxy_requests_total",
        "fastroute_proxy_ttft_seconds_bucket",
        "fastroute_proxy_tbot_seconds_bucket",
        "fastroute_proxy_engine_prefix_cache_hit_ratio",
        "fastroute_proxy_retries_total",
        "fastroute_proxy_retry_refused_total",
        "fastroute_proxy_ejections_total",
        "fastroute_controller_engine_health",
        "fastroute_proxy_shed_total",
        "fastroute_proxy_table_age_seconds",
        "fastroute_controller_table_generation",
        "fastroute_controller_solve_seconds_bucket",
        "vllm:num_requests_running",
    ):
        assert name in used, name


def test_promql_metric_names_parses_what_deploy_writes() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, engine) (rate(a_bucket{engine!="x",k=~"y"}[5m])))'
        " / scalar(sum(rate(vllm:b_total[$__rate_interval]))) > 1e-3 or c == bool 0"
    )
    assert promql_metric_names(expr) == {"a_bucket", "vllm:b_total", "c"}


def test_every_metric_used_is_exported(exported: dict[str, set[str]]) -> None:
    """The live proxy, controller and emulated vLLM engine scrapes, plus vLLM's names as the
    signal dialect reads them, plus the recording rules, cover every name used."""
    # the emulator writes vLLM's names: the dialect's list is what a real vLLM writes too
    assert vllm_names() & exported["engine"] >= {
        "vllm:num_requests_running",
        "vllm:time_to_first_token_seconds_bucket",
    }
    recorded = {r["record"] for r in _rules() if "record" in r}
    known = exported["proxy"] | exported["controller"] | vllm_names() | recorded
    known |= ADDED_BY_OTHER_CHANGES
    # no stale allow-list entry: each one is still read by the dashboard or the rules
    assert ADDED_BY_OTHER_CHANGES <= set().union(*map(promql_metric_names, _dashboard_exprs()))
    used = {
        "dashboard": set().union(*map(promql_metric_names, _dashboard_exprs())),
        "rules": set().union(*(promql_metric_names(r["expr"]) for r in _rules())),
    }
    for where, names in used.items():
        unknown = names - known
        assert not unknown, f"{where} reads metrics nothing exports: {sorted(unknown)}"
