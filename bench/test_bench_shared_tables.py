"""``bench/shared_tables.py``: a run per mode, and its refusal without the pure-Python core."""

from __future__ import annotations

import pytest
from shared_tables import main, run_mode


def test_a_run_with_the_workers_tables_apart_serves_requests() -> None:
    assert run_mode("hot-prompt", 0.7, 1, 2, "none") > 0


def test_sharing_needs_the_pure_python_twin(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("fastroute._env.NO_EXTENSIONS", False)
    assert main(["--seeds", "1"]) == 2
    assert "FASTROUTE_NO_EXTENSIONS=1" in capsys.readouterr().err
