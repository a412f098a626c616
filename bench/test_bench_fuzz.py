"""The fuzz targets of ``bench/fuzz`` accept every seed of their corpus (without
atheris: each target is a plain function of bytes), so the coverage-guided runs start
from inputs that pass."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

FUZZ = Path(__file__).parent / "fuzz"
sys.path.insert(0, str(FUZZ))

from targets import TARGETS  # noqa: E402


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_seed_passes_its_target(name: str) -> None:
    seeds = sorted((FUZZ / "corpus" / name).iterdir())
    assert seeds, f"no seed corpus for {name}"
    for seed in seeds:
        TARGETS[name](seed.read_bytes())


def test_a_nested_body_is_a_request_error_not_a_crash() -> None:
    """The known crash (RecursionError from a 100,000-deep unknown field) stays fixed."""
    TARGETS["requests"](b'{"model":"m","messages":[],"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}")
