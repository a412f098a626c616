"""``fastroute bench fleet``: spec checks, router templates, and a tiny run end to end."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastroute.fleetbench.configgen import ProxySettings, render_config
from fastroute.fleetbench.fleet import EngineGroup, FleetSpec, RegionSpec, plan_engines
from fastroute.fleetbench.routers import expand_command, resolve_router
from fastroute.fleetbench.spec import BenchSpecError, RouterCommand, load_spec
from fastroute.tables.segment import shm_dir
from fastroute.testing.processes import processes_naming

HERE = Path(__file__).resolve().parent

TINY = """
name = "tiny"
description = "CI smoke: two A40 engines, a few seconds of multi-turn chat."
routers = {routers}
duration_s = 5
drain_s = 5
seed = 3
load = 0.6
overhead_requests = 3
controller_period_s = 1.0

[fleet]
regions = [{{ name = "local" }}]

[[fleet.groups]]
name = "a40"
count = 2
profile = "a40"
model = "llama-3-8b"
region = "local"
capacity_rps = 2.0

[workload]
mean_turns = 3.0
think_time_s = 0.3
prompt_tokens = {{ median = 60.0, sigma = 0.5, min = 8, max = 512 }}
output_tokens = {{ median = 12.0, sigma = 0.5, min = 2, max = 32 }}
tenants = [{{ name = "t0", weight = 1.0, system_prompt_tokens = 128 }}]
models = [{{ name = "llama-3-8b" }}]
sources = [{{ name = "local" }}]

[[faults]]
at_s = 1.0
engine = "a40-1"
set = {{ slowdown = 2.0 }}

[fastroute_variants.split]
policy = "prefix-hrw"
workers = 2
proxies = 2

[router_commands.broken]
command = ["{{python}}", "-c", "import sys; print('no such router'); sys.exit(3)"]

[router_commands.dying]
command = ["{{python}}", "{dying}", "--port", "{{port}}", "--engine", "{{worker_urls_csv}}",
           "--exit-after-s", "1.5"]
"""


def _write(tmp_path: Path, routers: list[str], **replace: str) -> Path:
    text = TINY.format(routers=json.dumps(routers), dying=HERE / "dying_router.py")
    for old, new in replace.items():
        text = text.replace(old, new)
    path = tmp_path / "tiny.toml"
    path.write_text(text)
    return path


def test_spec_errors_name_the_problem(tmp_path: Path) -> None:
    """Inconsistent specs fail at load time with a specific message."""
    assert load_spec(_write(tmp_path, ["fastroute"])).fleet.capacity_rps() == 4.0
    cases = {
        "load = 0.6": ("load = 0.6\nconcurrency = 4", "exactly one of `load`"),
        'sources = [{ name = "local" }]': ('sources = [{ name = "mars" }]', "not a fleet region"),
        'models = [{ name = "llama-3-8b" }]': ('models = [{ name = "gpt" }]', "served by no"),
        "duration_s = 5": ("duration_s = -5", "duration_s"),
    }
    for old, (new, message) in cases.items():
        with pytest.raises(BenchSpecError, match=message):
            load_spec(_write(tmp_path, ["fastroute"], **{old: new}))


def test_router_names_and_templates() -> None:
    """Names resolve to fastroute policies or command templates; placeholders expand."""
    assert resolve_router("fastroute", {}).policy == "prefix-hrw"  # the default policy
    assert resolve_router("fastroute:round-robin", {}).policy == "round-robin"
    with pytest.raises(ValueError, match="unknown fastroute policy"):
        resolve_router("fastroute:nope", {})
    with pytest.raises(ValueError, match="give a policy"):
        resolve_router("sglang", {})
    with pytest.raises(ValueError, match="unknown router 'nginx'"):
        resolve_router("nginx", {})
    template = RouterCommand(command=("{python}", "r", "--w", "{worker_urls}", "--p", "{port}",
                                      "--csv={worker_urls_csv}", "{policy}"))  # fmt: skip
    cmd = expand_command(template, port=9, metrics_port=10, worker_urls=["u1", "u2"], policy="rr")
    assert cmd == [sys.executable, "r", "--w", "u1", "u2", "--p", "9", "--csv=u1,u2", "rr"]
    missing = RouterCommand(command=("x",), requires_module="no_such_module_here")
    assert "not importable" in (resolve_router("m", {"m": missing}).unavailable or "")


def test_generated_config_validates_and_names_every_engine() -> None:
    fleet = FleetSpec(
        regions=(RegionSpec(name="us", zone="us"), RegionSpec(name="eu", zone="eu")),
        rtt_ms={"us": {"eu": 80.0}},
        groups=(
            EngineGroup(name="h", count=2, profile="h100", model="m", region="us"),
            EngineGroup(name="a", count=1, profile="a40", model="m", region="eu"),
        ),
    )
    engines = plan_engines(fleet)
    assert [e.name for e in engines] == ["h-0", "h-1", "a-0"]
    assert len({e.port for e in engines}) == 3
    text = render_config(
        fleet, engines, ProxySettings("eu", 8080, "fastroute-test-stats"),
        table_name="fastroute-test-w", controller_port=8090, slo_s={"m": (1.0, 0.05)},
    )  # fmt: skip
    for e in engines:
        assert f'url = "{e.url}"' in text
    assert 'cluster = "eu"' in text and "ttft_slo_s = 1.0" in text
    with pytest.raises(ValueError, match="region 'mars'"):
        FleetSpec(
            regions=(RegionSpec(name="us"),),
            groups=(EngineGroup(name="x", model="m", region="mars"),),
        )


def _bench_leftovers() -> tuple[list[str], list[str]]:
    procs = processes_naming("fastroute-bench-")
    return procs, [p.name for p in shm_dir().glob("fastroute-bench-*")]


@pytest.mark.integration
@pytest.mark.slow
def test_tiny_spec_end_to_end_with_failing_routers(tmp_path: Path) -> None:
    """fastroute (one proxy, and two proxies of two workers), sglang-router when installed,
    run; broken/dying routers are reported."""
    routers = ["fastroute", "split", "broken", "dying"]
    if importlib.util.find_spec("sglang_router") is not None:
        routers.insert(1, "sglang:round_robin")
    spec = _write(tmp_path, routers)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "fastroute", "bench", "fleet", str(spec), "--out", str(out)],
        capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr  # a router failed: the run says so
    doc = json.loads((out / "results.json").read_text())
    by = {r["router"]: r for r in doc["results"]}
    assert list(by) == routers
    for name in routers[:-2]:
        r = by[name]
        assert r["status"] == "ok", r
        s = r["summary"]
        assert s["ok"] > 0 and s["ok"] == s["requests"], r
        assert abs(sum(r["engine_share"].values()) - 1.0) < 1e-9
        assert r["cache_hit_rate"] is not None and r["router_cpu_us_per_token"] > 0
        assert r["router_peak_rss_mb"] > 0 and r["overhead_added_p50_ms"] is not None
        assert "t=1 s: a40-1 {'slowdown': 2.0}" in r["detail"]  # the fault was applied
    for name in ("fastroute", "split"):  # the LP's shares over the window, per engine
        assert by[name]["lp_share"].keys() == {"a40-0", "a40-1"}, by[name]
        assert abs(sum(by[name]["lp_share"].values()) - 1.0) < 1e-9
    assert set(by["split"]["router_cpu_s_by_process"]) == {
        "controller", "proxy-local-0", "proxy-local-1"
    }  # fmt: skip
    assert by["broken"]["status"] == "failed to start"
    assert "no such router" in by["broken"]["detail"]
    assert by["dying"]["status"] == "died mid-run", by["dying"]
    assert "exited with status 3" in by["dying"]["detail"]
    assert doc["machine"]["cpus"] == os.cpu_count()
    md = (out / "results.md").read_text()
    assert "| fastroute | ok |" in md and "failed to start" in md and "died mid-run" in md
    assert _bench_leftovers() == ([], [])
