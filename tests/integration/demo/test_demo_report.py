"""The demo's printed parts: snippets that run as printed, the plan line, the engine table."""

from __future__ import annotations

import ast
import re
import subprocess

from fastroute.demo.report import keep_text, plan_text, summary_table, why_text
from fastroute.fleetbench.fleet import PlannedEngine
from fastroute.fleetbench.scrape import EngineCounters, ProxyCounters
from fastroute.loadgen import RequestRecord, summarize


def test_keep_snippets_are_valid_shell_and_python() -> None:
    text = keep_text("http://127.0.0.1:8080", "llama-3-8b", "fastroute-demo-x-weights")
    code = re.search(r"^python - <<'PY'\n(.*?)^PY$", text, re.S | re.M)
    assert code is not None
    ast.parse(code.group(1))  # runs as printed: no indentation inside the heredoc
    curl = text[text.index("curl") : text.index("python - <<")]
    assert subprocess.run(["bash", "-n"], input=curl, text=True).returncode == 0
    assert 'base_url="http://127.0.0.1:8080/v1"' in text


def test_plan_text_names_derated_engines() -> None:
    plan = {"generation": 7, "engines": [
        {"name": "a", "health_level": 1.0},
        {"name": "b", "health_level": 0.75, "health_reason": "ttft z=4.1"},
    ]}  # fmt: skip
    assert plan_text(plan) == "controller  generation 7; derated b to 0.75 of capacity (ttft z=4.1)"
    assert "no engine derated" in plan_text({"generation": 1, "engines": []})
    assert plan_text(None) == "controller plan: unavailable"


def test_why_text_has_one_aligned_line_per_explained_engine() -> None:
    plan = {"engines": [
        {"name": "us-east-h100-0", "why": "balanced: at 62 % utilisation"},
        {"name": "eu-a40", "why": "held in reserve: cheaper to serve eu-west from us-east"},
        {"name": "old", "health_level": 1.0},
    ]}  # fmt: skip
    assert why_text(plan).splitlines() == [
        "Why each engine gets its share (controller plan):",
        "  us-east-h100-0  balanced: at 62 % utilisation",
        "  eu-a40          held in reserve: cheaper to serve eu-west from us-east",
    ]
    assert why_text({"engines": []}) == "" and why_text(None) == ""


def test_summary_table_has_a_row_per_engine_and_the_totals() -> None:
    engines = [
        PlannedEngine(name=n, model="m", profile="a40", region="r", role="both",
                      capacity_rps=1.0, max_num_seqs=8, port=1, seed=0)
        for n in ("e-0", "e-1")
    ]  # fmt: skip
    recs = [
        RequestRecord(session_id="s", tenant="t", source="r", model="m", turn=0, sent_at_s=0.0,
                      status=200, engine="e-0", ttft_s=0.05, tbot_s=0.01, e2e_s=0.2,
                      output_tokens=5),
        RequestRecord(session_id="s", tenant="t", source="r", model="m", turn=1, sent_at_s=1.0,
                      error="deadline"),
    ]  # fmt: skip
    counters = {"e-0": EngineCounters(requests=1, prefix_queries_tokens=100,
                                      prefix_hits_tokens=40, prompt_tokens=100,
                                      generation_tokens=5), "e-1": None}  # fmt: skip
    proxies = {"r": ProxyCounters(retries=2, retry_refused=0, shed=1)}
    text = summary_table(summarize(recs, 2.0), engines, counters, proxies)
    row0 = next(line for line in text.splitlines() if line.startswith("e-0"))
    assert row0.split()[3:6] == ["1", "100%", "50"] and row0.endswith("40%")
    assert next(line for line in text.splitlines() if line.startswith("e-1")).endswith("—")
    assert "2 sent, 1 ok, errors: none (1 still running at the end, cancelled)" in text
    assert "2 retries, 1 requests shed" in text
