"""deploy/systemd/*.service: the settings operations rely on, and ``systemd-analyze verify``.

The units cannot run here (no systemd as PID 1 in CI); docs/operations.md explains each setting,
tests/integration/test_systemd_notify.py drives the notify protocol they depend on.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fastroute.cli import _build_parser
from fastroute.config import ProxyConfig
from fastroute.proxy.supervisor import KILL_GRACE_S

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "deploy" / "systemd"
NAMES = ("fastroute-proxy.service", "fastroute-controller.service")
CONFIG = "/etc/fastroute/fastroute.toml"


def _parse(path: Path) -> dict[str, list[str]]:
    """``Section.Key`` -> every value assigned (systemd allows repeated keys)."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return out


def _one(unit: dict[str, list[str]], key: str) -> str:
    values = unit.get(f"Service.{key}", [])
    assert len(values) == 1, f"{key}: {values}"
    return values[0]


def _seconds(value: str) -> float:
    assert value.endswith("s") and value[:-1].isdigit(), value
    return float(value[:-1])


@pytest.mark.parametrize("name", NAMES)
def test_unit_common_settings(name):
    unit = _parse(UNITS / name)
    assert _one(unit, "Type") == "notify"
    assert _one(unit, "NotifyAccess") == "main"  # only the supervisor / controller notifies
    assert _one(unit, "KillSignal") == "SIGTERM"
    assert _one(unit, "Restart") == "on-failure"
    for key, value in {
        "DynamicUser": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "NoNewPrivileges": "yes",
    }.items():
        assert _one(unit, key) == value, key
    families = _one(unit, "RestrictAddressFamilies").split()
    assert {"AF_INET", "AF_INET6", "AF_UNIX"} <= set(families)  # AF_UNIX: NOTIFY_SOCKET
    argv = shlex.split(_one(unit, "ExecStart"))
    assert argv[0].endswith("/fastroute")
    args = _build_parser().parse_args(argv[1:])  # every flag exists in this fastroute
    assert args.config == CONFIG
    assert _one(unit, "ConfigurationDirectory") == "fastroute"


def test_units_share_one_dynamic_user():
    """The controller's 0600 table must be readable by the proxy: same (dynamic) UID."""
    proxy, controller = (_parse(UNITS / n) for n in NAMES)
    assert _one(proxy, "User") == _one(controller, "User")
    assert _one(proxy, "Group") == _one(controller, "Group")


def test_proxy_unit_reload_and_stop():
    unit = _parse(UNITS / "fastroute-proxy.service")
    assert _one(unit, "ExecReload") == "/bin/kill -HUP $MAINPID"
    assert _one(unit, "KillMode") == "mixed"  # SIGTERM to the supervisor, which drains workers
    drain_s = ProxyConfig().drain_timeout_s
    assert _seconds(_one(unit, "TimeoutStopSec")) >= drain_s + KILL_GRACE_S
    # the readiness probe reads /proc/net/tcp*, which ProcSubset=pid hides
    assert "Service.ProcSubset" not in unit


def test_controller_unit_reload():
    """SIGHUP re-reads the controller's config without closing its listener or table."""
    unit = _parse(UNITS / "fastroute-controller.service")
    assert _one(unit, "ExecReload") == "/bin/kill -HUP $MAINPID"


@pytest.mark.integration
def test_systemd_analyze_verify(tmp_path):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed")
    fastroute = Path(sys.executable).parent / "fastroute"
    if not fastroute.exists():
        pytest.skip(f"no {fastroute} console script")
    for name in NAMES:  # ExecStart must name an existing executable: point it at this venv
        text = (UNITS / name).read_text()
        text = text.replace("/opt/fastroute/venv/bin/fastroute", str(fastroute))
        (tmp_path / name).write_text(text)
    result = subprocess.run(
        [tool, "verify", *(str(tmp_path / n) for n in NAMES)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr.strip() == "", result.stderr  # warnings too
