"""``fastroute bench fleet``'s overrides: ``--duration`` and ``--seed``."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastroute.fleetbench.cli import overridden
from fastroute.fleetbench.runner import build_sessions
from fastroute.fleetbench.spec import BenchSpecError, load_spec

SPEC = Path(__file__).resolve().parents[3] / "examples" / "bench" / "families" / "rag-70.toml"


def test_a_seed_override_draws_other_sessions_and_keeps_everything_else():
    spec = load_spec(SPEC)
    (same,) = overridden([spec])
    (other,) = overridden([spec], seed=spec.seed + 1, duration_s=12.5)
    assert same == spec
    assert other.seed == spec.seed + 1 and other.duration_s == 12.5
    assert other.name == spec.name and other.routers == spec.routers and other.load == spec.load
    assert build_sessions(other)[0] != build_sessions(spec)[0]


@pytest.mark.parametrize(
    ("changes", "message"),
    [({"duration_s": 0.0}, "--duration must be > 0"), ({"seed": -1}, "--seed must be >= 0")],
)
def test_a_bad_override_names_the_option(changes, message):
    with pytest.raises(BenchSpecError, match=message):
        overridden([load_spec(SPEC)], **changes)
