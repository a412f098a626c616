"""Prefix keys passed between proxies' key logs (``fastroute.policy.key_exchange``)."""

from __future__ import annotations

import msgspec
import pytest

from fastroute import _core
from fastroute.policy.key_exchange import MAX_EXPORT_ENTRIES, KeyExchange, KeyLogExport
from fastroute.policy.prefix_hrw import private_key_log


def _host(labels: tuple[str, ...] = ("proxy:prefix-hrw", "prefill:prefix-hrw")):
    """A host's log, its exchange end and a worker's reader of each channel."""
    log = private_key_log(64)
    readers = [_core.KeyLog(log, 100 + c, c) for c in range(len(labels))]
    return log, KeyExchange(log, labels), readers


def _observed(reader: _core.KeyLog) -> list[float]:
    hot, seen = _core.HotKeys(1e9), _core.HotKeys(1e9)
    reader.drain(hot, seen)
    return [seen.share(k) for k in (11, 21, 31)]


def test_a_peers_own_entries_reach_the_channel_of_the_same_label_once() -> None:
    _, a, a_readers = _host()
    b_log, b, b_readers = _host(("prefill:prefix-hrw", "proxy:prefix-hrw"))  # other order
    a_readers[0].publish([11], 1, 2**64 - 1)  # a's proxy channel, and where it went
    a_readers[1].publish([21], 1)  # a's prefill channel
    export = msgspec.json.decode(msgspec.json.encode(a.export(-1)), type=KeyLogExport)
    assert export.next == 2 and [e[0] for e in export.entries] == [0, 1]
    assert b.absorb(export) == 2
    assert _observed(b_readers[1]) == [1.0, 0.0, 0.0]  # proxy keys on b's proxy channel
    assert _observed(b_readers[0]) == [0.0, 1.0, 0.0]
    hot, seen = _core.HotKeys(1e9), _core.HotKeys(1e9)
    _core.KeyLog(b_log, 200, 1).drain(hot, seen)
    assert seen.engine(11) == 2**64 - 1  # the engine crossed with the keys
    # b exports only its own entries: what it imported never goes back to a (or on).
    b_readers[1].publish([31], 1)
    back = b.export(-1)
    assert [e[2] for e in back.entries] == [[31]]
    assert a.absorb(back) == 1 and a.export(export.next).entries == []
    assert a.absorb(a.export(export.next)) == 0  # nothing new, nothing twice


def test_entries_the_host_cannot_place_are_dropped_and_counted() -> None:
    _, a, a_readers = _host(("proxy:prefix-hrw", "decode:prefix-hrw"))
    _, b, _ = _host(("proxy:prefix-hrw",))
    a_readers[0].publish([11], 1)
    a_readers[1].publish([21], 1)
    assert b.absorb(a.export(-1)) == 1  # of 2
    bogus = KeyLogExport(5, ["proxy:prefix-hrw"], [(3, 1, [9])])  # channel past the labels
    assert b.absorb(bogus) == 0
    for entries in (
        b"[[0, 1, [18446744073709551616]]], [0]",
        b"[[0, 1, [1]]], [18446744073709551616]",
    ):
        too_wide = msgspec.json.decode(
            b'[5, ["proxy:prefix-hrw"], ' + entries + b"]", type=KeyLogExport
        )
        assert b.absorb(too_wide) == 0  # msgspec bounds ints at int64, not 64 bits


def test_a_peer_of_the_version_before_the_engines_still_exchanges_keys() -> None:
    """Entries without their engines (an older peer) are imported with engine 0 (not
    known); an older peer ignores the trailing field."""
    log, b, _ = _host(("proxy:prefix-hrw",))
    older = msgspec.json.decode(b'[1, ["proxy:prefix-hrw"], [[0, 1, [11]]]]', type=KeyLogExport)
    assert older.engines == [] and b.absorb(older) == 1
    hot, seen = _core.HotKeys(1e9), _core.HotKeys(1e9)
    _core.KeyLog(log, 300, 0).drain(hot, seen)
    assert seen.share(11) == 1.0 and seen.engine(11) == 0
    newer = msgspec.json.encode(KeyLogExport(1, ["p"], [(0, 1, [11])], [5]))
    assert newer == b'[1,["p"],[[0,1,[11]]],[5]]'

    class Older(msgspec.Struct, array_like=True):
        next: int
        channels: list[str]
        entries: list[tuple[int, int, list[int]]]

    assert msgspec.json.decode(newer, type=Older).entries == [(0, 1, [11])]


def test_an_answer_reads_at_most_max_export_entries_positions() -> None:
    log = private_key_log(4096)
    exchange = KeyExchange(log, ("proxy:prefix-hrw",))
    writer = _core.KeyLog(log, 1, 0)
    for i in range(MAX_EXPORT_ENTRIES + 10):
        writer.publish([i + 1], 1)
    first = exchange.export(-1)
    assert first.next == MAX_EXPORT_ENTRIES and len(first.entries) == MAX_EXPORT_ENTRIES
    assert len(exchange.export(first.next).entries) == 10


@pytest.mark.parametrize(
    "answer",
    [
        b'[0, ["p"], [[0, 1, [-1]]]]',  # a negative key
        b'[0, ["p"], [[0, 1, [1]]], [-1]]',  # a negative engine id
        b'[0, ["p"], [[256, 1, [1]]]]',  # channel past 255
        b'[-1, ["p"], []]',  # a negative position
        b'[0, ["p"], [[0, 1, [' + b",".join([b"1"] * 65) + b"]]]]",  # 65 keys
    ],
)
def test_a_peers_answer_out_of_range_is_refused(answer: bytes) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(answer, type=KeyLogExport)
