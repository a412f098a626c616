"""Spec texts and trace files shared by the fleet-benchmark unit tests (not a test module)."""

from __future__ import annotations

from pathlib import Path

from fastroute.testing.traces import write_azure_csv

#: A 1P+1D replay spec; ``{trace}`` is formatted in (relative to the spec file).
PD_SPEC = """
name = "pd-tiny"
routers = ["fastroute:round-robin", "mc-uncal"]
duration_s = 20
warmup_s = 5
seed = 4
{load}
controller = false

[slo]
ttft_s = 0.175
tbot_s = 0.0397

[fastroute_variants.mc-uncal]
policy = "marginal-cost"
params = {{ calibrate = false, infeasible = "reject" }}

[fleet]
regions = [{{ name = "local" }}]

[[fleet.groups]]
name = "prefill"
profile = "a40-qwen2.5-3b"
step_time_factors = {{ a0_s = 1.5, b0_s = 1.5 }}
model = "qwen2.5-3b"
region = "local"
role = "prefill"
capacity_rps = 3.0

[[fleet.groups]]
name = "decode"
count = 2
profile = "a40-qwen2.5-3b"
step_time_factors = {{ a0_s = 1.5, b0_s = 1.5 }}
model = "qwen2.5-3b"
region = "local"
role = "decode"
capacity_rps = 4.0

[replay]
model = "qwen2.5-3b"
rate_rps = 2.5
burst_every_s = 10
burst_s = 2
burst_factor = 2.0
components = [
  {{ name = "conv", path = "{trace}", share = 0.75, max_offset = 20 }},
  {{ name = "code", path = "{trace}", share = 0.25, max_offset = 20 }},
]
"""


def write_pd_spec(tmp_path: Path, *, load: str = "load = 0.5", **replace: str) -> Path:
    """Write :data:`PD_SPEC` (with its trace in ``tmp_path/traces``); return its path."""
    (tmp_path / "traces").mkdir(exist_ok=True)
    write_azure_csv(tmp_path / "traces" / "t.csv", 400)
    text = PD_SPEC.format(load=load, trace="traces/t.csv")
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / "pd.toml"
    path.write_text(text)
    return path
