"""The host's key log, compiled against its spec (``fastroute._core.keylog_py``).

Tests parametrised with ``log_cls`` run against every implementation present; the parity
tests share one buffer between the two (same layout) and compare the decisions of pickers
that share a log. Module-level ``parity`` marker: re-run with ``FASTROUTE_NO_EXTENSIONS=1``.
"""

from __future__ import annotations

import numpy as np
import pytest

from fastroute import _core
from fastroute._core.keylog_py import (
    ENTRY_WORDS,
    HEADER_WORDS,
    init_key_log,
    key_log_size,
)
from fastroute._core.prefix_py import MAX_DEPTH_KEYS
from fastroute.hashing import engine_id
from fastroute.policy import RouteRequest

pytestmark = pytest.mark.parity

LOGS = {"py": (_core.KeyLogPy, _core.HotKeysPy, _core.PrefixPickerPy)}
if _core.KeyLogC is not None:
    LOGS["cy"] = (_core.KeyLogC, _core.HotKeysC, _core.PrefixPickerC)


@pytest.fixture(params=sorted(LOGS), ids=sorted(LOGS))
def impl(request: pytest.FixtureRequest) -> tuple[type, type, type]:
    return LOGS[request.param]


def _log(capacity: int = 16) -> bytearray:
    buf = bytearray(key_log_size(capacity))
    init_key_log(buf, capacity)
    return buf


def _tables(hot_cls: type) -> tuple[object, object]:
    return hot_cls(1e9), hot_cls(1e9)


def test_init_rejects_bad_capacities_and_short_buffers() -> None:
    for capacity in (0, 8, 24):
        with pytest.raises(ValueError, match="power of two"):
            init_key_log(bytearray(key_log_size(32)), capacity)
    with pytest.raises(ValueError, match="needs"):
        init_key_log(bytearray(key_log_size(16) - 8), 16)


def test_a_log_refuses_what_is_not_a_log(impl: tuple[type, type, type]) -> None:
    log_cls = impl[0]
    buf = _log()
    with pytest.raises(ValueError, match="key log"):
        log_cls(bytearray(len(buf)), 1, 0)  # no magic
    with pytest.raises(ValueError, match="key log"):
        log_cls(buf[: key_log_size(16) - 8], 1, 0)  # truncated
    bad = bytearray(buf)
    bad[8:16] = (99).to_bytes(8, "little")  # another layout version
    with pytest.raises(ValueError, match="key log"):
        log_cls(bad, 1, 0)
    with pytest.raises(ValueError, match="writer_id"):
        log_cls(buf, 2**32, 0)
    with pytest.raises(ValueError, match="channel"):
        log_cls(buf, 1, 256)


def test_other_writers_entries_of_the_channel_are_observed(
    impl: tuple[type, type, type],
) -> None:
    log_cls, hot_cls, _ = impl
    buf = _log()
    a, b, other_channel = log_cls(buf, 1, 0), log_cls(buf, 2, 0), log_cls(buf, 3, 1)
    a.publish([11, 12, 13], 2)
    a.publish([21], 1)
    other_channel.publish([31, 32], 2)
    hot, seen = _tables(hot_cls)
    assert b.drain(hot, seen) == 2 and b.observed == 2 and b.lost == 0
    assert hot.requests == seen.requests == 2
    assert hot.share(11) == pytest.approx(0.5) and hot.share(13) == 0.0  # n_observe = 2
    assert seen.share(13) == pytest.approx(0.5) and seen.share(31) == 0.0  # not b's channel
    assert b.drain(hot, seen) == 0 and b.position == 3  # nothing new
    own_hot, own_seen = _tables(hot_cls)
    assert a.drain(own_hot, own_seen) == 0 and own_hot.requests == 0  # its own entries


def test_a_lapped_reader_skips_what_was_overwritten(impl: tuple[type, type, type]) -> None:
    log_cls, hot_cls, _ = impl
    buf = _log(16)
    writer, reader = log_cls(buf, 1, 0), log_cls(buf, 2, 0)
    for i in range(21):
        writer.publish([100 + i], 1)
    hot, seen = _tables(hot_cls)
    assert reader.drain(hot, seen) == 16 and reader.lost == 5
    assert seen.share(104) == 0.0 and seen.share(105) > 0.0  # the 16 newest
    late = log_cls(buf, 3, 0)  # a new reader starts one capacity back: a warm start
    assert late.position == 5
    assert late.drain(*_tables(hot_cls)) == 16


def test_an_entry_left_half_written_is_skipped_not_waited_for(
    impl: tuple[type, type, type],
) -> None:
    """A writer killed between reserving an entry and publishing it: head moved, seq 0."""
    log_cls, hot_cls, _ = impl
    buf = _log()
    writer, reader = log_cls(buf, 1, 0), log_cls(buf, 2, 0)
    writer.publish([1], 1)
    words = memoryview(buf).cast("Q")
    words[4] += 1  # head++ of the dead writer; its entry's seq stays 0
    writer.publish([3], 1)
    hot, seen = _tables(hot_cls)
    assert reader.drain(hot, seen) == 2 and reader.lost == 1
    assert seen.share(1) == pytest.approx(0.5) == seen.share(3)


def test_keys_past_the_entry_are_dropped(impl: tuple[type, type, type]) -> None:
    log_cls, hot_cls, _ = impl
    buf = _log()
    writer, reader = log_cls(buf, 1, 0), log_cls(buf, 2, 0)
    keys = list(range(1, ENTRY_WORDS + 10))
    writer.publish(keys, 100)
    hot, seen = _tables(hot_cls)
    reader.drain(hot, seen)
    assert len(seen) == len(hot) == MAX_DEPTH_KEYS == ENTRY_WORDS - 3


def test_export_reads_the_hosts_own_entries_from_a_position(
    impl: tuple[type, type, type],
) -> None:
    log_cls = impl[0]
    buf = _log(16)
    a, b = log_cls(buf, 1, 0), log_cls(buf, 2, 3)
    a.publish([11, 12], 1, 2**64 - 1)
    b.publish([21], 1)
    a.publish_imported([31, 32, 33], 2, 7)  # came from another proxy: never re-exported
    a.publish([41], 0, 5)
    assert a.export(-1, 100) == (
        4,
        [(0, 1, [11, 12], 2**64 - 1), (3, 1, [21], 0), (0, 0, [41], 5)],
    )
    assert a.export(1, 2) == (3, [(3, 1, [21], 0)])  # max_entries counts positions read
    assert a.export(4, 100) == (4, [])  # nothing new
    assert a.export(9, 100)[0] == 4  # ahead of head: the log was recreated, start over
    for i in range(20):
        a.publish([100 + i], 1)
    next_position, entries = a.export(2, 100)  # lapped: from the oldest entry held
    assert next_position == 24 and [k for _, _, k, _ in entries][0] == [104]
    assert a.observed == 0 and a.position == 0  # export is no drain


def test_imported_entries_are_observed_on_their_channel(impl: tuple[type, type, type]) -> None:
    log_cls, hot_cls, _ = impl
    buf = _log()
    importer, reader = log_cls(buf, 5, 0), log_cls(buf, 6, 2)
    importer.publish_imported([1, 2, 3], 1, 2, 77)
    importer.publish_imported([9], 1, 0)  # another channel
    hot, seen = _tables(hot_cls)
    assert reader.drain(hot, seen) == 1
    assert hot.share(1) == 1.0 and hot.share(2) == 0.0 and seen.share(3) == 1.0
    assert seen.engine(3) == 77 and seen.engine(9) == 0
    with pytest.raises(ValueError, match="channel"):
        importer.publish_imported([1], 1, 256)


def test_a_whole_prompt_key_goes_to_the_whole_prompts_table_alone(
    impl: tuple[type, type, type],
) -> None:
    """An entry published with a whole prompt key carries it last, marked ``WHOLE``: a
    reader counts it in the whole prompts' table only (not in the share or seen table),
    every request ticks that table's clock, and an export leaves it out (the whole
    prompts' shares are the host's)."""
    log_cls, hot_cls, _ = impl
    buf = _log()
    a, b = log_cls(buf, 1, 0), log_cls(buf, 2, 0)
    a.publish([11, 12], 5, 7, whole=99)  # n_observe clipped to the two keys
    a.publish([21], 1)  # no whole key (a declared session): counts in the clock alone
    hot, seen = _tables(hot_cls)
    wholes = hot_cls(1e9)
    assert b.drain(hot, seen, wholes) == 2
    assert hot.share(12) == pytest.approx(0.5) and hot.share(99) == 0.0
    assert seen.share(99) == 0.0 and seen.engine(12) == 7 and len(seen) == 3
    assert wholes.requests == 2 and wholes.share(99) == pytest.approx(0.5) and len(wholes) == 1
    assert a.export(-1, 100) == (2, [(0, 2, [11, 12], 7), (0, 1, [21], 0)])
    c = log_cls(buf, 3, 0)  # a reader without the table sees the keys alone
    hot, seen = _tables(hot_cls)
    assert c.drain(hot, seen) == 2 and len(seen) == 3
    full = list(range(1, MAX_DEPTH_KEYS + 1))
    a.publish(full, 1, whole=5)  # no room left: the whole key is dropped, not a key
    hot, seen = _tables(hot_cls)
    wholes = hot_cls(1e9)
    assert b.drain(hot, seen, wholes) == 1 and len(seen) == MAX_DEPTH_KEYS and len(wholes) == 0


# Defined only when the extension is built, so the pure-Python run has nothing to skip.
if "cy" in LOGS:

    def test_both_implementations_read_each_others_entries() -> None:
        buf = _log(64)
        py, cy = _core.KeyLogPy(buf, 1, 0), _core.KeyLogC(buf, 2, 0)
        py.publish([5, 6, 7], 1, 41)
        cy.publish([8, 9], 2, 2**64 - 2)
        hot_c, seen_c = _tables(_core.HotKeysC)
        hot_p, seen_p = _tables(_core.HotKeysPy)
        assert cy.drain(hot_c, seen_c) == 1 and py.drain(hot_p, seen_p) == 1
        assert hot_c.share(5) == 1.0 and hot_c.share(6) == 0.0 and seen_c.share(7) == 1.0
        assert hot_p.share(8) == hot_p.share(9) == 1.0
        assert seen_c.engine(7) == 41 and seen_p.engine(9) == 2**64 - 2
        assert hot_c.engine(5) == hot_p.engine(8) == 0  # the share table records none
        assert bytes(buf[: 8 * HEADER_WORDS]) == bytes(_log(64)[:32]) + (2).to_bytes(
            8, "little"
        ) + bytes(24)

    def test_both_implementations_export_and_import_alike() -> None:
        buf = _log(16)
        py, cy = _core.KeyLogPy(buf, 1, 0), _core.KeyLogC(buf, 2, 1)
        for i in range(24):
            (py if i % 3 else cy).publish([i, i + 1000], i % 3, i * 7)
            if i % 5 == 0:
                (cy if i % 2 else py).publish_imported([7 * i], 1, i % 4)
        for since, max_entries in ((-1, 100), (0, 5), (12, 3), (29, 100), (40, 1), (31, 0)):
            assert py.export(since, max_entries) == cy.export(since, max_entries)

    def test_pickers_sharing_a_log_decide_as_the_spec() -> None:
        """Two workers' pickers over one log, compiled and spec side by side: every
        decision agrees, and so do the tables after each worker drained the other."""
        rng = np.random.default_rng(11)
        n = 12
        sel = _core.SelectorC([engine_id(f"kl-{i}") for i in range(n)], np.ones((1, n)))
        params = (256, 8192, 2.0, 0.5, 64.0)
        buf_py, buf_cy = _log(64), _log(64)
        workers = [
            (
                _core.PrefixPickerPy(*params),
                _core.PrefixPickerC(*params),
            )
            for _ in range(2)
        ]
        for w, (py, cy) in enumerate(workers):
            py.attach_log(_core.KeyLogPy(buf_py, w, 0))
            cy.attach_log(_core.KeyLogC(buf_cy, w, 0))
        shared = [bytes(rng.integers(97, 123, size=2000, dtype=np.uint8)) for _ in range(3)]
        for step in range(400):
            head = shared[int(rng.integers(0, 3))] if rng.random() < 0.8 else b""
            tail = bytes(rng.integers(97, 123, size=int(rng.integers(0, 3000)), dtype=np.uint8))
            request = RouteRequest(int(rng.integers(0, 2**63)), 0, 100, head + tail, None, -1)
            loads = rng.integers(0, 5, size=n).astype(np.int64) * 300
            py, cy = workers[int(rng.integers(0, 2))]
            decision = py.choose(sel, request, None, loads, 3)
            assert decision == cy.choose(sel, request, None, loads, 3), step
            sent = decision[0][0] if rng.random() < 0.7 else int(rng.integers(0, n))
            py.on_routed(request, int(sel.engine_ids[sent]))
            cy.on_routed(request, int(sel.engine_ids[sent]))
        for py, cy in workers:
            assert py.hot.requests == cy.hot.requests > 350  # each counts both workers'
            assert len(py.seen) == len(cy.seen) and py.log.observed == cy.log.observed


def test_a_picker_attached_late_replays_the_log(impl: tuple[type, type, type]) -> None:
    """A worker that starts (or reloads) after the others warms its tables at attach
    time, from the entries the log still holds, not in its first decision."""
    log_cls, _, picker_cls = impl
    buf = _log(16)
    writer = log_cls(buf, 1, 0)
    for i in range(20):
        writer.publish([7, 100 + i], 1)
    picker = picker_cls(512, 4096, 2.0, 0.5, 1e9)
    picker.attach_log(log_cls(buf, 2, 0))
    assert picker.hot.requests == picker.seen.requests == 16  # the capacity's newest
    assert picker.hot.share(7) == pytest.approx(1.0) and picker.seen.share(119) > 0.0
    assert picker.log.lost == 0  # it started a capacity back: nothing overwritten under it


def test_a_released_log_refuses_work(impl: tuple[type, type, type]) -> None:
    log_cls, hot_cls, _ = impl
    log = log_cls(_log(), 1, 0)
    log.release()
    with pytest.raises(ValueError, match="released"):
        log.publish([1], 1)
    with pytest.raises(ValueError, match="released"):
        log.drain(*_tables(hot_cls))
