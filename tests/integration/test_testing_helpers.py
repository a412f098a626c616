"""The shared test helpers themselves: config fragments, process handling, bounded polling."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from fastroute.config import decode_config
from fastroute.testing.configs import engines_toml
from fastroute.testing.processes import free_port, http_get, kill_groups, processes_naming
from fastroute.testing.waiting import poll_until

URLS = ["http://127.0.0.1:9", "http://127.0.0.1:10"]


def test_engines_toml_decodes_with_names_roles_and_capacities() -> None:
    toml = engines_toml(
        URLS, "m", names=["p", "d"], roles=["prefill", "decode"], capacity_rps=[5.0, "7.5"]
    )
    config = decode_config(toml + '[proxy]\ntable_name = "t"\n', source="t.toml")
    got = [(e.name, e.url, e.models, e.role, e.capacity_rps) for e in config.engines]
    assert got == [
        ("p", URLS[0], ("m",), "prefill", 5.0),
        ("d", URLS[1], ("m",), "decode", 7.5),
    ]
    defaults = decode_config(engines_toml(URLS, "m"), source="d.toml").engines
    assert [(e.name, e.capacity_rps, e.hardware) for e in defaults] == [
        ("engine-0", 10.0, "h100"),
        ("engine-1", 10.0, "h100"),
    ]


def test_engines_toml_refuses_lists_of_the_wrong_length() -> None:
    with pytest.raises(ValueError, match="roles has 1 entries for 2 engines"):
        engines_toml(URLS, "m", roles=["prefill"])


def test_poll_until_fails_after_its_bound() -> None:
    calls = []
    with pytest.raises(AssertionError, match="waiting for never"):
        poll_until(lambda: bool(calls.append(1)), "never", timeout=0.1, interval=0.01)
    assert len(calls) >= 2
    poll_until(lambda: True, "at once", timeout=0.0)


@pytest.mark.integration
def test_processes_are_found_by_name_and_their_groups_killed() -> None:
    """A child in its own session that waits on stdin is found by its marker and killed."""
    marker = f"fastroute-test-helper-{uuid.uuid4().hex[:12]}"
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()", marker],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        poll_until(lambda: bool(processes_naming(marker)), "the child to exec", timeout=10.0)
        found = processes_naming(marker)
        assert len(found) == 1 and found[0].startswith(f"{proc.pid}: ")
    finally:
        kill_groups([proc])
    assert proc.returncode is not None and proc.stdin is not None and proc.stdin.closed
    assert processes_naming(marker) == []


@pytest.mark.integration
def test_http_get_answers_zero_when_nothing_listens() -> None:
    assert http_get(free_port(), "/health", timeout_s=1.0) == (0, b"")
