"""The start rule in the proxy: a table left behind is not adopted until a live writer publishes."""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
import pytest

from fastroute.config import decode_config
from fastroute.hashing import engine_id
from fastroute.proxy.background.start_table import StartTable
from fastroute.proxy.background.table_watch import TableWatcher
from fastroute.proxy.path.fleet import Fleet
from fastroute.proxy.proxy_app import ProxyApp
from fastroute.proxy.routes import get_reply
from fastroute.tables import TableSnapshot, TableWriter

_CONFIG = """
[[engines]]
name = "e0"
url = "http://127.0.0.1:9"
models = ["m"]
capacity_rps = 1.0
[[engines]]
name = "e1"
url = "http://127.0.0.1:10"
models = ["m"]
capacity_rps = 3.0
"""
IDS = [engine_id("e0"), engine_id("e1")]


def _leave_table(name: str, age_s: float, epoch: int | None = 5) -> None:
    """Publish generation 1 (all weight on e0) ``age_s`` ago, then let the writer go."""
    with TableWriter(name, max_engines=4, max_classes=8) as writer:
        meta = {} if epoch is None else {"epoch": epoch}
        writer.write(
            TableSnapshot.validated(
                1, IDS, np.array([[1.0, 0.0]]), published_at=time.time() - age_s, meta=meta
            )
        )


def _watcher(name: str, start: StartTable) -> TableWatcher:
    return TableWatcher(Fleet(decode_config(_CONFIG)), name, start=start)


def test_an_old_table_without_writer_is_held_until_a_live_writer_publishes(
    shm_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    _leave_table(shm_name, age_s=3600.0)
    start = StartTable(shm_name, max_age_s=60.0, pulls=False)
    with caplog.at_level(logging.WARNING):
        verdict = start.judge()
    assert verdict is not None and verdict.reason == "too_old" and not verdict.use
    assert "fastroute table stale --remove" in caplog.text
    watcher = _watcher(shm_name, start)
    assert not watcher.poll() and watcher.fleet.state.source == "config"
    info = start.ready_info()
    assert info is not None and info["reason"] == "too_old" and info["epoch"] == 5
    assert info["used"] is False and 3599.0 < float(info["age_s"]) < 3700.0  # type: ignore[arg-type]
    with TableWriter(shm_name) as live:  # a controller (or puller) starts writing
        live.publish(IDS, np.array([[0.0, 1.0]]))
        assert watcher.poll() and watcher.fleet.state.generation == 2
    assert start.verdict is None and start.ready_info() is None


def test_a_fresh_table_without_writer_is_used_when_nobody_can_confirm_it(shm_name: str) -> None:
    _leave_table(shm_name, age_s=5.0, epoch=None)
    start = StartTable(shm_name, max_age_s=60.0, pulls=False)
    start.judge()
    watcher = _watcher(shm_name, start)
    assert watcher.poll() and watcher.fleet.state.source == "table"
    info = start.ready_info()  # used, and said so
    assert info is not None and info["reason"] == "fresh" and info["used"] is True
    assert info["epoch"] is None


def test_a_puller_waits_for_the_controllers_table_even_when_fresh(shm_name: str) -> None:
    _leave_table(shm_name, age_s=5.0)
    start = StartTable(shm_name, max_age_s=60.0, pulls=True)
    verdict = start.judge()
    assert verdict is not None and verdict.reason == "unconfirmed"
    watcher = _watcher(shm_name, start)
    assert not watcher.poll() and watcher.fleet.state.source == "config"
    weights = watcher.fleet.state.weights[0]
    assert weights.tolist() == [1.0, 3.0]  # capacity weights, not the table's [1, 0]


def test_a_table_with_a_live_writer_is_current(shm_name: str) -> None:
    with TableWriter(shm_name, max_engines=4, max_classes=8) as writer:
        writer.write(
            TableSnapshot.validated(
                1, IDS, np.array([[1.0, 0.0]]), published_at=time.time() - 3600.0
            )
        )
        start = StartTable(shm_name, max_age_s=60.0, pulls=False)
        assert start.judge() is None and start.ready_info() is None
        watcher = _watcher(shm_name, start)
        assert watcher.poll() and watcher.fleet.state.source == "table"


def test_no_table_is_nothing_to_judge(shm_name: str) -> None:
    start = StartTable(shm_name, max_age_s=60.0, pulls=True)
    assert start.judge() is None
    assert not _watcher(shm_name, start).poll()


def test_the_hold_survives_a_reload_of_the_app(shm_name: str) -> None:
    """A reload builds a new table watcher; it must not adopt the table the start rule held."""
    config = decode_config(
        _CONFIG + f'[controller]\nport = 0\n[proxy]\ntable_name = "{shm_name}"\n'
    )
    _leave_table(shm_name, age_s=3600.0)

    async def main() -> None:
        async with ProxyApp(config) as app:
            assert app.context.fleet.state.source == "config"
            assert await app.reload(config)
            assert app.context.fleet.state.source == "config"
            reply = get_reply(app.context, "/ready", {}, "127.0.0.1", app.start_table)
            assert b'"reason":"too_old"' in reply.body and b'"weights":"config"' in reply.body
            with TableWriter(shm_name) as live:
                live.publish(IDS, np.array([[0.0, 1.0]]))
                for _ in range(100):  # the watcher polls every 0.5 s
                    if app.context.fleet.state.source == "table":
                        break
                    await asyncio.sleep(0.05)
            assert app.context.fleet.state.generation == 2 and app.start_table.verdict is None

    asyncio.run(asyncio.wait_for(main(), 30.0))
