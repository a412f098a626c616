"""``bench/shared_tables.py``: a run per mode, and its refusal of twin modes without the twin."""

from __future__ import annotations

import pytest
from shared_tables import main, run_mode


@pytest.mark.parametrize("mode", ["apart", "log", "no-exchange", "fleet-log"])
def test_a_run_per_mode_serves_requests(mode: str) -> None:
    goodput_rps, hit = run_mode("hot-prompt", 0.7, 1, 2, mode, proxies=1 if mode == "apart" else 2)
    assert goodput_rps > 0
    assert 0.5 < hit <= 1.0  # one system prompt for everybody: most prompt tokens cached


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--workers", "0"])
    assert "--workers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--set", "no-equals-sign"])
    assert "expected KEY=VALUE" in capsys.readouterr().err


def test_settings_and_seeds_are_printed(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--family", "hot-prompt", "--loads", "0.7", "--seeds", "2", "--workers", "1"]
    assert main([*argv, "--modes", "apart", "--per-seed", "--set", "duration_s=60"]) == 0
    out = capsys.readouterr().out
    assert "duration_s=60" in out and out.count("; seeds ") == 1


def test_sharing_the_twins_tables_needs_the_pure_python_twin(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("fastroute._env.NO_EXTENSIONS", False)
    assert main(["--seeds", "1", "--modes", "apart,seen"]) == 2
    assert "FASTROUTE_NO_EXTENSIONS=1" in capsys.readouterr().err
