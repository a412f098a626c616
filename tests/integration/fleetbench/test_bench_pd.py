"""P/D validation on the fleet benchmark: true step times in the fleet process, and a tiny
replay spec through fastroute variants end to end."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from fastroute.fleetbench.fleet import EngineGroup, FleetSpec, RegionSpec
from fastroute.fleetbench.process import ProcessSet
from fastroute.fleetbench.stack import start_fleet
from fastroute.tables.segment import shm_dir
from fastroute.testing.processes import processes_naming

pytestmark = pytest.mark.integration

PROFILE = "a40-qwen2.5-3b"
#: Prefill coefficients ×10 on the "true" group.
PREFILL_X10 = {"a0_s": 10.0, "a1_s": 10.0, "a2_s": 10.0, "a3_s": 10.0}


def test_true_step_times_reach_the_fleet_process(tmp_path: Path) -> None:
    """The group's factors cross into the bench's fleet process: the engine of the "true"
    group reports them in ``/metrics`` under the datasheet profile name, the other none
    (that an engine built with factors runs the scaled profile is
    tests/unit/emulator/test_emulator_step_time_factors.py; no timing is asserted here)."""
    fleet = FleetSpec(
        regions=(RegionSpec(name="local"),),
        groups=(
            EngineGroup(name="datasheet", model="qwen", region="local", profile=PROFILE),
            EngineGroup(name="true", model="qwen", region="local", profile=PROFILE,
                        step_time_factors=PREFILL_X10),
        ),
    )  # fmt: skip

    async def main() -> tuple[str, str]:
        procs = ProcessSet(tmp_path)
        try:
            _, engines = await start_fleet(procs, fleet, tmp_path)
            pages = []
            async with aiohttp.ClientSession() as http:
                for engine in engines:
                    async with http.get(engine.url + "/metrics") as r:
                        pages.append(await r.text())
            return pages[0], pages[1]
        finally:
            await asyncio.to_thread(procs.stop_all)

    nominal_page, true_page = asyncio.run(asyncio.wait_for(main(), 60.0))
    assert 'step_time_factors="a0_s=10,a1_s=10,a2_s=10,a3_s=10"' in true_page
    assert 'step_time_factors=""' in nominal_page
    assert f'profile="{PROFILE}"' in true_page and f'profile="{PROFILE}"' in nominal_page


SPEC = """
name = "pd-smoke"
description = "CI smoke: 1 prefill + 1 decode, a replayed trace, two fastroute variants."
routers = ["fastroute:round-robin", "mc-cal"]
duration_s = 2
warmup_s = 0
drain_s = 10
seed = 2
load = 0.5
overhead_requests = 0
controller = false

[slo]
ttft_s = 0.175
tbot_s = 0.0397

[fastroute_variants.mc-cal]
policy = "marginal-cost"
params = {{ calibrate = true, infeasible = "reject" }}

[fleet]
regions = [{{ name = "local" }}]

[[fleet.groups]]
name = "prefill"
profile = "{profile}"
step_time_factors = {{ a0_s = 1.5, b0_s = 1.5 }}
model = "qwen2.5-3b"
region = "local"
role = "prefill"
capacity_rps = 6.0

[[fleet.groups]]
name = "decode"
profile = "{profile}"
step_time_factors = {{ a0_s = 1.5, b0_s = 1.5 }}
model = "qwen2.5-3b"
region = "local"
role = "decode"
capacity_rps = 20.0

[replay]
model = "qwen2.5-3b"
rate_rps = 3.0
components = [{{ name = "conv", path = "trace.csv", max_offset = 10 }}]
"""


@pytest.mark.slow
def test_pd_replay_spec_through_two_variants(tmp_path: Path) -> None:
    """Both arms run over prefill → decode, every request is accounted for (ok, 429 or
    error), and the report has the goodput table; nothing is left behind."""
    rows = ["timestamp_s,prompt_tokens,output_tokens"]
    rows += [f"{i * 0.25:.2f},{200 + 37 * i},{4 + i % 5}" for i in range(40)]
    (tmp_path / "trace.csv").write_text("\n".join(rows) + "\n")
    spec = tmp_path / "pd.toml"
    spec.write_text(SPEC.format(profile=PROFILE))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "fastroute", "bench", "fleet", str(spec), "--out", str(out)],
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((out / "results.json").read_text())
    by = {r["router"]: r for r in doc["results"]}
    assert list(by) == ["fastroute:round-robin", "mc-cal"]
    for name, r in by.items():
        assert r["status"] == "ok", r
        s = r["summary"]
        assert s["requests"] >= 3 and s["ok"] > 0, (name, s)
        assert s["ok"] + sum(s["errors"].values()) == s["requests"]
        assert r["target_rps"] == pytest.approx(3.0)  # 0.5 × min(6, 20)
        # Disaggregated: each served request ran on the prefill and on the decode engine.
        assert r["engine_requests"]["prefill-0"] > 0 and r["engine_requests"]["decode-0"] > 0
    md = (out / "results.md").read_text()
    assert "| router | goodput | TTFT p99 ms | TBOT p99 ms | sent | 429 | other errors |" in md
    assert "| mc-cal | ok |" in md and "trace replay (conv 1;" in md
    assert processes_naming("fastroute-bench-") == []
    assert [p.name for p in shm_dir().glob("fastroute-bench-*")] == []
