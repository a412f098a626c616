"""``fastroute engine`` as a real process: readiness lines, serving, clean SIGTERM stop."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
READY = re.compile(r"^engine (\S+) listening on (http://127\.0\.0\.1:\d+)$")


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_engine_command_serves_and_stops_on_sigterm():
    """N engines print a ready line each, answer /health and /v1/models, exit 0 on SIGTERM."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastroute", "--log-level", "WARNING", "engine", "--count", "3",
         "--base-port", "0", "--profile", "l4", "--model", "test-model", "--region", "eu",
         "--drain"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        urls = {}
        deadline = time.monotonic() + 30
        while len(urls) < 3:
            assert time.monotonic() < deadline, "engines did not become ready"
            line = proc.stdout.readline()
            assert line, f"process exited early: {proc.stderr.read()}"
            match = READY.match(line.strip())
            assert match, line
            urls[match.group(1)] = match.group(2)
        assert sorted(urls) == ["engine-0", "engine-1", "engine-2"]
        assert len(set(urls.values())) == 3
        for url in urls.values():
            status, body = _get(url + "/v1/models")
            assert status == 200 and json.loads(body)["data"][0]["id"] == "test-model"
            assert _get(url + "/health")[0] == 503  # started with --drain
            status, metrics = _get(url + "/metrics")
            assert b'region="eu"' in metrics and b'profile="l4"' in metrics
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
        proc.stdout.close()
        proc.stderr.close()


def test_engine_command_rejects_invalid_faults():
    """An out-of-range fault flag is a usage error (exit 2) with a message."""
    result = subprocess.run(
        [sys.executable, "-m", "fastroute", "engine", "--error-rate", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 2 and "error_rate" in result.stderr
