"""Request ids: unique, prefixed, fresh in another process and after a fork."""

from __future__ import annotations

import os
import subprocess
import sys

from fastroute.proxy.path.handler import new_request_id


def test_request_ids_unique_and_prefixed() -> None:
    """Request ids unique and prefixed."""
    ids = [new_request_id() for _ in range(1000)]
    assert len(set(ids)) == 1000
    assert all(i.startswith("req-") for i in ids)


def test_request_ids_differ_in_another_process() -> None:
    """Request ids differ in another process."""
    code = "from fastroute.proxy.path.handler import new_request_id; print(new_request_id())"
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert (
        other.startswith("req-") and other.rsplit("-", 1)[0] != new_request_id().rsplit("-", 1)[0]
    )


def test_request_ids_new_prefix_after_fork() -> None:
    """Request ids new prefix after fork."""
    parent = new_request_id().rsplit("-", 1)[0]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.write(w, new_request_id().encode())
        os._exit(0)
    os.close(w)
    child = os.read(r, 200).decode()
    os.waitpid(pid, 0)
    os.close(r)
    assert child.rsplit("-", 1)[0] != parent
