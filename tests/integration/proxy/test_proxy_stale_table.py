"""A proxy started next to a table left behind by a writer that is gone (real processes).

A child process publishes a weight table (all weight on ``engine-1``, an hour old, epoch 12) and
exits, as a controller stopped long ago would. A ``fastroute serve`` with no controller must not
route on it: ``/ready`` says ``weights: config`` and describes the stale table, requests spread
over both engines (capacity weights), the log names ``fastroute table stale --remove``, and that
command removes the table.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import pytest

from fastroute.testing.configs import engines_toml
from fastroute.testing.processes import (
    child_env,
    free_port,
    http_get,
    kill_groups,
    start_engines,
    start_fastroute,
)
from fastroute.testing.waiting import poll_until

pytestmark = pytest.mark.integration

MODEL = "demo-8b"

_LEAVE_TABLE = """
import sys, time
import numpy as np
from fastroute.hashing import class_key, engine_id
from fastroute.tables import TableSnapshot, TableWriter
name, model = sys.argv[1], sys.argv[2]
keys = [class_key("local", model, p) for p in ("batch", "default", "interactive")]
ids = [engine_id("engine-0"), engine_id("engine-1")]
snap = TableSnapshot.validated(
    1, ids, np.array([[0.0, 1.0]] * 3), class_keys=keys,
    published_at=time.time() - 3600.0, meta={"epoch": 12},
)
with TableWriter(name) as writer:
    writer.write(snap)
"""


def _complete(port: int, i: int) -> str:
    """One completion through the proxy; the engine it chose (``x-fastroute-engine``)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        body = {"model": MODEL, "prompt": f"request {i} {uuid.uuid4().hex}", "max_tokens": 2}
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200, resp.status
        return resp.getheader("x-fastroute-engine") or ""
    finally:
        conn.close()


def test_a_table_left_by_a_dead_writer_does_not_steer_a_new_proxy(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    env = child_env(shm)
    table = f"fastroute-test-{uuid.uuid4().hex[:12]}-weights"
    subprocess.run([sys.executable, "-c", _LEAVE_TABLE, table, MODEL], env=env, check=True)
    assert (shm / table).exists()  # the writer exited: its lock is free, the table stays
    procs: list[subprocess.Popen[bytes]] = []
    try:
        engines, urls = start_engines(2, env, model=MODEL)
        procs.append(engines)
        port = free_port()
        config = tmp_path / "fastroute.toml"
        config.write_text(
            engines_toml(urls, MODEL)
            + "[controller]\nport = 0\n"  # no controller anywhere: no reports, no puller
            + f'[proxy]\nport = {port}\ntable_name = "{table}"\n'
            + f'stats_name = "{table}-stats"\n'
        )
        log = tmp_path / "proxy.log"
        procs.append(
            start_fastroute(["serve", "--config", str(config), "--workers", "1"], env, log)
        )
        poll_until(lambda: http_get(port, "/ready")[0] == 200, "proxy /ready")
        ready = json.loads(http_get(port, "/ready")[1])
        assert ready["weights"] == "config" and ready["generation"] == 0
        stale = ready["stale_table"]
        assert stale["name"] == table and stale["epoch"] == 12 and stale["generation"] == 1
        assert stale["reason"] == "too_old" and stale["used"] is False
        assert 3600.0 <= stale["age_s"] < 3900.0
        chosen = Counter(_complete(port, i) for i in range(40))
        # capacity weights (10 rps each); the stale table would send all 40 to engine-1
        assert set(chosen) == {"engine-0", "engine-1"}, chosen
        assert "fastroute table stale --remove" in log.read_text()
        listed = subprocess.run(
            [sys.executable, "-m", "fastroute", "table", "stale", "--remove"],
            env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert f"removed {table}" in listed.stdout
        assert not (shm / table).exists()
    finally:
        kill_groups(procs)
