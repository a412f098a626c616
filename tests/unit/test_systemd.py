"""``fastroute.systemd``: sd_notify over a real AF_UNIX datagram socket, and the listen probe."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from fastroute.systemd import (
    Notifier,
    listening_inodes,
    monotonic_usec,
    parse_notify_address,
    pids_listening,
)
from fastroute.testing.waiting import wait_until


def _receiver(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(5.0)
    return sock


def _fields(datagram: bytes) -> dict[str, str]:
    text = datagram.decode()
    assert text.endswith("\n"), text
    return dict(line.split("=", 1) for line in text.splitlines())


@pytest.fixture
def notify_path(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    path = str(tmp_path / "notify.sock")
    sock = _receiver(path)
    try:
        yield path, sock
    finally:
        sock.close()


@pytest.fixture(autouse=True)
def close_notifiers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Close every Notifier a test made (their sockets would leak a ResourceWarning)."""
    made: list[Notifier] = []
    init = Notifier.__init__

    def tracking_init(self: Notifier, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        made.append(self)

    monkeypatch.setattr(Notifier, "__init__", tracking_init)
    yield
    for sd in made:
        sd.close()


def _nothing_pending(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        sock.recv(4096)
    except BlockingIOError:
        return True
    finally:
        sock.settimeout(5.0)
    return False


def test_disabled_without_notify_socket(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    sd = Notifier.from_env()
    assert not sd.enabled
    assert sd.ready("up") is False
    assert sd.stopping() is False
    assert sd.keepalive() is False


def test_ready_with_status_reaches_a_path_socket(notify_path):
    path, sock = notify_path
    with Notifier(path) as sd:
        assert sd.enabled
        assert sd.ready("2 workers\nrunning") is True
    assert sock.recv(4096) == b"READY=1\nSTATUS=2 workers running\n"


def test_abstract_socket_name():
    name = f"fastroute-test-{uuid.uuid4().hex}"
    sock = _receiver("\0" + name)
    try:
        sd = Notifier("@" + name)
        assert sd.notify(READY=1) is True
        assert _fields(sock.recv(4096)) == {"READY": "1"}
        sd.close()
    finally:
        sock.close()


def test_parse_notify_address():
    assert parse_notify_address("/run/systemd/notify") == "/run/systemd/notify"
    assert parse_notify_address("@abc") == "\0abc"
    for bad in ("", "@", "relative/path", "vsock:2:1234"):
        with pytest.raises(ValueError, match="NOTIFY_SOCKET"):
            parse_notify_address(bad)


def test_unsupported_address_disables_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="fastroute.systemd"):
        sd = Notifier("vsock:2:1234")
    assert not sd.enabled and sd.ready() is False
    assert "vsock:2:1234" in caplog.text


def test_reloading_carries_monotonic_usec(notify_path):
    path, sock = notify_path
    sd = Notifier(path)
    before = monotonic_usec()
    assert sd.reloading("reloading the workers")
    after = monotonic_usec()
    fields = _fields(sock.recv(4096))
    assert fields["RELOADING"] == "1" and fields["STATUS"] == "reloading the workers"
    assert before <= int(fields["MONOTONIC_USEC"]) <= after
    # the same clock as CLOCK_MONOTONIC, which systemd compares against
    assert abs(int(fields["MONOTONIC_USEC"]) - time.monotonic_ns() // 1000) < 60_000_000


def test_stopping_with_timeout_extension(notify_path):
    path, sock = notify_path
    sd = Notifier(path)
    assert sd.stopping("draining", extend_timeout_s=40.0)
    assert _fields(sock.recv(4096)) == {
        "STOPPING": "1",
        "STATUS": "draining",
        "EXTEND_TIMEOUT_USEC": "40000000",
    }
    assert sd.stopping()
    assert _fields(sock.recv(4096)) == {"STOPPING": "1", "STATUS": "stopping"}


def test_status_is_sent_only_when_it_changes(notify_path):
    path, sock = notify_path
    sd = Notifier(path)
    assert sd.status("a") is True
    assert sd.status("a") is False
    assert sd.status("b") is True
    assert sock.recv(4096) == b"STATUS=a\n"
    assert sock.recv(4096) == b"STATUS=b\n"
    assert _nothing_pending(sock)
    sd.ready("b")  # READY always goes out; its status counts as the last one sent
    assert sock.recv(4096) == b"READY=1\nSTATUS=b\n"
    assert sd.status("b") is False


def test_missing_receiver_never_raises_and_warns_once(tmp_path, caplog):
    sd = Notifier(str(tmp_path / "absent.sock"))
    with caplog.at_level(logging.DEBUG, logger="fastroute.systemd"):
        assert sd.ready() is False
        assert sd.ready() is False
    levels = [r.levelno for r in caplog.records if r.name == "fastroute.systemd"]
    assert levels == [logging.WARNING, logging.DEBUG]


def test_full_receiver_does_not_block(notify_path):
    """A receiver that never reads fills up; sends then fail at once instead of blocking."""
    path, sock = notify_path
    sd = Notifier(path)
    results = [sd.notify(STATUS=f"message {i}") for i in range(2000)]
    assert results[0] is True
    assert False in results  # the queue filled; the call returned instead of blocking
    assert sock.recv(4096) == b"STATUS=message 0\n"


def test_from_env_unsets_the_variables_and_reads_the_watchdog(monkeypatch, notify_path):
    path, sock = notify_path
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    sd = Notifier.from_env()
    for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        assert key not in os.environ  # children (proxy workers) do not inherit them
    assert sd.enabled and sd.watchdog_interval_s == 1.0
    assert sd.keepalive(now_s=100.0) is True
    assert sd.keepalive(now_s=100.5) is False
    assert sd.keepalive(now_s=101.0) is True
    assert sock.recv(4096) == b"WATCHDOG=1\n"
    assert sock.recv(4096) == b"WATCHDOG=1\n"
    assert _nothing_pending(sock)


def test_watchdog_of_another_pid_is_ignored(monkeypatch, notify_path):
    path, _ = notify_path
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    sd = Notifier.from_env(unset=False)
    assert os.environ["NOTIFY_SOCKET"] == path
    assert sd.enabled and sd.watchdog_interval_s is None
    assert sd.keepalive() is False


def test_follow_sends_ready_once_the_status_exists_then_changes(notify_path):
    path, sock = notify_path
    sd = Notifier(path)
    state: dict[str, str | None] = {"status": None}
    polls = [0]

    def status() -> str | None:
        polls[0] += 1
        return state["status"]

    async def scenario() -> list[dict[str, str]]:
        loop = asyncio.get_running_loop()
        task = asyncio.create_task(sd.follow(status, poll_s=0.01, interval_s=0.01))
        try:
            await wait_until(lambda: polls[0] >= 3, timeout=5.0)
            assert _nothing_pending(sock)  # polled, not ready: nothing was sent
            state["status"] = "generation 1"
            first = _fields(await loop.run_in_executor(None, sock.recv, 4096))
            state["status"] = "generation 2"
            second = _fields(await loop.run_in_executor(None, sock.recv, 4096))
            return [first, second]
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    first, second = asyncio.run(asyncio.wait_for(scenario(), 10.0))
    assert first == {"READY": "1", "STATUS": "generation 1"}
    assert second == {"STATUS": "generation 2"}


def test_follow_returns_at_once_when_disabled():
    asyncio.run(asyncio.wait_for(Notifier(None).follow(lambda: None), 5.0))


# -- listen probe ------------------------------------------------------------------------------


def test_pids_listening_sees_only_listening_sockets_of_the_given_pids():
    listener = socket.create_server(("127.0.0.1", 0))
    bound = socket.socket()
    bound.bind(("127.0.0.1", 0))  # bound, not listening: the supervisor's reservation
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    try:
        port = listener.getsockname()[1]
        me = os.getpid()
        assert pids_listening([me, child.pid], port) == {me}
        assert pids_listening([child.pid], port) == set()
        assert pids_listening([me], bound.getsockname()[1]) == set()
        assert pids_listening([], port) == set()
        listener.close()
        assert pids_listening([me], port) == set()
    finally:
        listener.close()
        bound.close()
        child.communicate(b"", timeout=10)


def test_pids_listening_ipv6():
    if not socket.has_ipv6:
        pytest.skip("no IPv6 support")
    try:
        listener = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback: {exc}")
    with listener:
        assert pids_listening([os.getpid()], listener.getsockname()[1]) == {os.getpid()}


def test_pids_listening_without_proc_net(tmp_path):
    """No /proc/net (not Linux, ProcSubset=pid): "cannot tell" (None), nothing raises."""
    assert pids_listening([os.getpid()], 8080, proc=str(tmp_path)) is None


def test_listening_inodes_parses_both_tables(tmp_path):
    header = "sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode\n"
    rest = "00000000:00000000 00:00000000 00000000 0 0"

    def row(local: str, remote: str, state: str, inode: int) -> str:
        return f"0: {local} {remote} {state} {rest} {inode} 1\n"

    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "tcp").write_text(
        header
        + row("0100007F:1F90", "00000000:0000", "0A", 111)  # 127.0.0.1:8080 LISTEN
        + row("0100007F:1F90", "0100007F:C350", "01", 222)  # an established connection
        + row("0100007F:1F91", "00000000:0000", "0A", 333)  # another port
    )
    (tmp_path / "net" / "tcp6").write_text(
        header + row("0" * 24 + "01000000:1F90", "0" * 32 + ":0000", "0A", 444)  # [::1]:8080
    )
    assert listening_inodes(8080, proc=str(tmp_path)) == {111, 444}  # 0x1F90, LISTEN only
    assert listening_inodes(8082, proc=str(tmp_path)) == set()


# -- the controller's STATUS= line (controller/cli.py) -----------------------------------------


def test_controller_status_before_and_after_the_first_period():
    from types import SimpleNamespace

    from aiohttp import web

    from controller.app import SERVICE
    from controller.cli import _systemd_status

    app = web.Application()
    svc = SimpleNamespace(plan=None, last_error=None, generation=0, last_reload_error=None)
    app[SERVICE] = svc  # type: ignore[assignment]
    assert _systemd_status(app) is None  # not ready: no period has ended
    svc.last_error = "Time limit reached: 4 classes x 2 engines"
    assert _systemd_status(app) == (
        "table generation 0; last period failed: Time limit reached: 4 classes x 2 engines"
    )  # ready anyway: the controller serves its plan page and retries every period
    svc.plan, svc.last_error, svc.generation = object(), None, 3
    assert _systemd_status(app) == "serving; table generation 3"
    svc.last_reload_error = "fastroute.toml: Expected float > 0.0 - at $.engines[1].capacity_rps"
    assert _systemd_status(app) == (
        "serving; table generation 3; config reload FAILED (running on the previous config): "
        "fastroute.toml: Expected float > 0.0 - at $.engines[1].capacity_rps"
    )
