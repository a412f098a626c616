"""Run Debian's ``promtool`` (``deploy/system_packages.sh`` installs it); without it, fail.

Never a skip: the rules would otherwise go untested silently.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
RULES = ROOT / "deploy" / "prometheus" / "fastroute-rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "fastroute-rules.test.yml"


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``promtool args…`` in ``cwd``; fails the test with a clear message when it is missing."""
    exe = shutil.which("promtool")
    if exe is None:
        pytest.fail(
            "promtool is not installed: run deploy/system_packages.sh (Debian package "
            "'prometheus'), which `make test` runs first"
        )
    return subprocess.run(
        [exe, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )
