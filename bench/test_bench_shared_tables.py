"""``bench/shared_tables.py``: a run per mode, and its refusal of twin modes without the twin."""

from __future__ import annotations

import pytest
from shared_tables import main, run_mode


@pytest.mark.parametrize("mode", ["apart", "log", "fleet-log"])
def test_a_run_per_mode_serves_requests(mode: str) -> None:
    goodput_rps, hit = run_mode(
        "hot-prompt", 0.7, 1, 2, mode, proxies=2 if mode == "fleet-log" else 1
    )
    assert goodput_rps > 0
    assert 0.5 < hit <= 1.0  # one system prompt for everybody: most prompt tokens cached


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--workers", "0"])
    assert "--workers" in capsys.readouterr().err


def test_sharing_the_twins_tables_needs_the_pure_python_twin(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("fastroute._env.NO_EXTENSIONS", False)
    assert main(["--seeds", "1", "--modes", "apart,seen"]) == 2
    assert "FASTROUTE_NO_EXTENSIONS=1" in capsys.readouterr().err
