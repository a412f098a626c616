"""Bench spec checks for ``[replay]``, ``controller`` and ``[fastroute_variants]``."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_specs import write_pd_spec

from fastroute.fleetbench.spec import BenchSpecError, load_spec


def test_a_replay_spec_loads_with_its_directory(tmp_path: Path) -> None:
    spec = load_spec(write_pd_spec(tmp_path))
    assert spec.replay is not None and spec.workload is None
    assert Path(spec.base_dir) == tmp_path.resolve()
    assert spec.controller is False
    assert spec.fastroute_variants["mc-uncal"].params == {
        "calibrate": False,
        "infeasible": "reject",
    }


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ('name = "pd-tiny"', 'name = "pd-tiny"\n[workload]\nmean_turns = 2.0',
         r"exactly one of \[workload\] and \[replay\]"),
        ("[replay]", "[not_replay]", "unknown field|exactly one of"),
        ("seed = 4", "seed = 4\nconcurrency = 3", r"\[replay\] is open loop"),
        ('model = "qwen2.5-3b"\nrate_rps', 'model = "gpt"\nrate_rps', "replay model 'gpt'"),
        ('path = "traces/t.csv", share = 0.25', 'path = "traces/no.csv", share = 0.25',
         "component 'code': trace file not found"),
        ("burst_s = 2\n", "burst_s = 6\n", "burst_factor \\* burst_s < burst_every_s"),
        ("calibrate = false", "calibrate = false, colour = 1", "variant 'mc-uncal'.*colour"),
        ('policy = "marginal-cost"', 'policy = "fastest"', "Invalid enum value 'fastest'"),
        ("[fastroute_variants.mc-uncal]", '[fastroute_variants."fastroute:x"]',
         "name taken by another router"),
    ],
)  # fmt: skip
def test_replay_and_variant_errors_name_the_problem(
    tmp_path: Path, old: str, new: str, message: str
) -> None:
    path = write_pd_spec(tmp_path, **{old: new})
    with pytest.raises(BenchSpecError, match=message):
        load_spec(path)


def test_a_spec_needs_a_workload_or_a_replay(tmp_path: Path) -> None:
    text = write_pd_spec(tmp_path).read_text()
    start = text.index("[replay]")
    path = tmp_path / "none.toml"
    path.write_text(text[:start])
    with pytest.raises(BenchSpecError, match=r"exactly one of \[workload\] and \[replay\]"):
        load_spec(path)
