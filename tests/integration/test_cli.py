"""The installed ``fastroute`` command: version, help, table inspection."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fastroute import __version__
from fastroute.tables import TableWriter

pytestmark = pytest.mark.integration


def _fastroute(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fastroute", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_version_and_help() -> None:
    """--version prints the package version; no command prints help and exits 2."""
    assert _fastroute("--version").stdout.strip() == f"fastroute {__version__}"
    result = _fastroute()
    assert result.returncode == 2 and "table" in result.stdout


def test_table_show_prints_the_published_table(shm_name) -> None:
    """`fastroute table show NAME --json` reads the live table from another process."""
    with TableWriter(shm_name, max_engines=4, max_classes=2) as writer:
        writer.publish([5, 6], [[1.0, 3.0]], retry_ratio=0.2, meta={"plan": 7})
        result = _fastroute("table", "show", shm_name, "--json")
        text = _fastroute("table", "show", shm_name)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["generation"] == 1
    assert shown["engine_ids"] == [5, 6] and shown["weights"] == [[1.0, 3.0]]
    assert shown["retry_ratio"] == 0.2 and shown["meta"] == {"plan": 7}
    assert "generation 1" in text.stdout and "0x6=0.750" in text.stdout


def test_table_show_reports_a_missing_table(shm_name) -> None:
    """A missing segment is a one-line error and exit status 1, not a traceback."""
    result = _fastroute("table", "show", shm_name)
    assert result.returncode == 1
    assert "no shared-memory segment" in result.stderr and "Traceback" not in result.stderr
