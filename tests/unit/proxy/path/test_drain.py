"""Drain hand-off times per engine: marked by reloads and weight tables, read per chunk."""

from __future__ import annotations

import math

import numpy as np

from fastroute.config import decode_config
from fastroute.hashing import engine_id
from fastroute.proxy.path.drain import NEVER, DrainMarks
from fastroute.proxy.path.fleet import Fleet
from fastroute.tables import FLAG_DRAINING, FLAG_UNAVAILABLE, TableSnapshot

_CONFIG = "".join(
    f'[[engines]]\nname = "e{i}"\nurl = "http://127.0.0.1:{9000 + i}"\nmodels = ["m"]\n\n'
    for i in range(3)
)


def test_a_mark_sets_the_handoff_time_once_and_a_table_clears_it() -> None:
    marks = DrainMarks(3, after_s=5.0)
    assert marks.handoff_at == [NEVER] * 3 and marks.enabled
    marks.mark([1], now=100.0)
    marks.mark([1], now=200.0)  # already draining: the first time stays
    assert marks.handoff_at == [NEVER, 105.0, NEVER] and marks.draining(1)
    marks.follow(np.array([1, 1, 0], dtype=np.uint8), now=300.0)
    assert marks.handoff_at == [NEVER, NEVER, 305.0]


def test_an_engine_gone_from_the_config_stays_draining() -> None:
    marks = DrainMarks(2, after_s=0.0)
    marks.gone([0], now=10.0)
    marks.follow(np.ones(2, dtype=bool), now=20.0)  # a later table lists it available
    assert marks.handoff_at == [10.0, NEVER]


def test_a_negative_delay_never_hands_off() -> None:
    marks = DrainMarks(2, after_s=-1.0)
    marks.gone([0], now=1.0)
    marks.follow(np.zeros(2, dtype=bool), now=1.0)
    assert not marks.enabled and marks.handoff_at == [math.inf, math.inf]


def test_the_fleet_follows_table_flags_and_reloads() -> None:
    fleet = Fleet(decode_config(_CONFIG + "\n[retry]\ndrain_handoff_after_s = 2\n"))
    assert fleet.drain.handoff_at == [NEVER] * 3
    ids = [engine_id(f"e{i}") for i in range(3)]
    flags = [0, FLAG_DRAINING, FLAG_UNAVAILABLE]
    snap = TableSnapshot.validated(
        1, ids, np.ones((len(fleet.row_keys), 3)), class_keys=fleet.row_keys, engine_flags=flags
    )
    fleet.apply_snapshot(snap)
    at = fleet.drain.handoff_at
    assert at[0] == NEVER and at[1] != NEVER and at[2] == at[1]
    assert fleet.leaving({"e1", "e2"}) == ["e0"]
    assert fleet.drain.draining(0)
