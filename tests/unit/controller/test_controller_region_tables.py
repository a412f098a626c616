"""controller.region_tables: a region's block of the table, and the wire cache of /v1/table."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from controller.model import FleetModel
from controller.publish import TablePublisher
from controller.region_tables import (
    EncodedTables,
    UnknownClusterError,
    cluster_rows,
    region_snapshot,
)
from fastroute.config import PRIORITIES, decode_config
from fastroute.hashing import class_key, engine_id
from fastroute.proxy.path.fleet import Fleet
from fastroute.tables import TableReader, TableSnapshot
from fastroute.tables.layout import FLAG_DRAINING, FLAG_UNAVAILABLE
from fastroute.tables.wire import decode_snapshot, encode_snapshot

MODEL = "demo-8b"
REGIONS = ("east", "west", "north")
#: engine-i runs in REGIONS[i // 2]
ENGINES = [f"engine-{i}" for i in range(6)]


def config_toml(cluster: str = "east") -> str:
    engines = "".join(
        f'[[engines]]\nname = "{name}"\nurl = "http://127.0.0.1:{9 + i}"\n'
        f'models = ["{MODEL}"]\nregion = "{REGIONS[i // 2]}"\nhardware = "h100"\n'
        "capacity_rps = 10.0\n\n"
        for i, name in enumerate(ENGINES)
    )
    regions = "".join(f'[[network.regions]]\nname = "{r}"\n\n' for r in REGIONS)
    rtt = "[network.rtt_ms]\neast = { west = 60.0, north = 40.0 }\nwest = { north = 70.0 }\n\n"
    return engines + regions + rtt + f'[proxy]\ncluster = "{cluster}"\n'


def model() -> FleetModel:
    return FleetModel.from_config(decode_config(config_toml(), source="test.toml"))


def full_table(generation: int = 7) -> tuple[TableSnapshot, tuple[str, ...]]:
    """Rows of three regions over six engines: each region's rows weight its own two engines
    and, for east, engine-2 (west) too; engine-5 (north) drains, engine-3 (west) is down."""
    m = model()
    n_g, n_e = len(m.classes), len(m.engine_names)
    rng = np.random.default_rng(1)
    w = np.zeros((n_g, n_e))
    for g, c in enumerate(m.classes):
        home = REGIONS.index(c.cluster)
        cols = [2 * home, 2 * home + 1] + ([2] if c.cluster == "east" else [])
        w[g, cols] = rng.uniform(0.1, 1.0, len(cols))
    w /= w.sum(axis=1, keepdims=True)
    flags = np.zeros(n_e, dtype=np.uint8)
    flags[5] = FLAG_DRAINING
    flags[3] = FLAG_UNAVAILABLE
    snap = TableSnapshot.validated(
        generation,
        m.engine_ids,
        w,
        class_keys=m.class_keys,
        engine_flags=flags,
        shed_fraction=rng.uniform(0.0, 0.5, n_g),
        retry_ratio=0.05,
        published_at=1_234.5,
        meta={"epoch": 3, "plan_id": 11, "tenant_shed": {"acme": 0.25}},
    )
    return snap, tuple(c.cluster for c in m.classes)


def ids(*engines: int) -> list[int]:
    return [engine_id(ENGINES[i]) for i in engines]


def test_cluster_rows_groups_rows_in_table_order() -> None:
    rows = cluster_rows(["a", "b", "a", "c", "b"])
    assert {k: v.tolist() for k, v in rows.items()} == {"a": [0, 2], "b": [1, 4], "c": [3]}


def test_a_region_gets_its_rows_over_weighted_and_flagged_engines() -> None:
    """Rows: the region's classes (keys, weights, shed). Columns: engines weighted in those rows
    (east: 0, 1 and west's 2) plus every flagged one (3 down, 5 draining), in table order; engine
    4 (north, unweighted, unflagged) is dropped. Generation, time, retry ratio, meta carry over."""
    snap, clusters = full_table()
    rows = cluster_rows(clusters)
    east = region_snapshot(snap, rows["east"])
    assert east.engine_ids.tolist() == ids(0, 1, 2, 3, 5)
    assert east.engine_flags.tolist() == [0, 0, 0, FLAG_UNAVAILABLE, FLAG_DRAINING]
    keys = [class_key("east", MODEL, p) for p in PRIORITIES]
    assert east.class_keys.tolist() == keys
    np.testing.assert_array_equal(east.weights, snap.weights[rows["east"]][:, [0, 1, 2, 3, 5]])
    np.testing.assert_allclose(east.weights.sum(axis=1), 1.0)  # nothing weighted is cut
    np.testing.assert_array_equal(east.shed_fraction, snap.shed_fraction[rows["east"]])
    assert (east.generation, east.published_at, east.retry_ratio) == (7, 1_234.5, 0.05)
    assert east.meta_bytes == snap.meta_bytes and east.meta["epoch"] == 3
    assert east.verify() and east.checksum != snap.checksum
    north = region_snapshot(snap, rows["north"])
    assert north.engine_ids.tolist() == ids(3, 4, 5)  # own engines and the flagged one


def test_rows_in_any_order_give_those_rows() -> None:
    """Contiguous rows are read as a view, others gathered: both give the rows asked for."""
    snap, _ = full_table()
    for rows in ([0, 1, 2], [5, 0, 7], [8, 7, 6], [4]):
        block = region_snapshot(snap, rows)
        assert block.class_keys.tolist() == snap.class_keys[rows].tolist()
        cols = [snap.engine_ids.tolist().index(i) for i in block.engine_ids.tolist()]
        np.testing.assert_array_equal(block.weights, snap.weights[np.ix_(rows, cols)])
        assert (snap.weights[rows] > 0).any(axis=0).sum() <= len(cols)


def test_an_all_zero_row_and_an_empty_region_keep_the_flagged_engines() -> None:
    """A fully shed row (all zero) stays a row; a region without rows is just the flags."""
    snap, clusters = full_table()
    w = snap.weights.copy()
    is_west = np.array(clusters) == "west"
    w[is_west] = 0.0  # west: every row fully shed
    shed = np.where(is_west, 1.0, snap.shed_fraction)
    snap = TableSnapshot.validated(
        snap.generation,
        snap.engine_ids,
        w,
        class_keys=snap.class_keys,
        engine_flags=snap.engine_flags,
        shed_fraction=shed,
    )
    west = region_snapshot(snap, cluster_rows(clusters)["west"])
    assert west.n_classes == len(PRIORITIES) and not west.weights.any()
    assert west.engine_ids.tolist() == ids(3, 5) and (west.shed_fraction == 1.0).all()
    empty = region_snapshot(snap, [])
    assert empty.n_classes == 0 and empty.engine_ids.tolist() == ids(3, 5)


def test_the_proxys_fleet_state_is_the_same_for_its_own_rows() -> None:
    """A proxy of each region maps its block exactly as the full table: weights, the positive
    mask, availability, shed fractions, retry ratio and tenant meta (through the wire)."""
    snap, clusters = full_table()
    rows = cluster_rows(clusters)
    for region in REGIONS:
        fleet = Fleet(decode_config(config_toml(region), source="proxy.toml"))
        block = decode_snapshot(encode_snapshot(region_snapshot(snap, rows[region])))
        a, b = fleet.state_from_snapshot(snap), fleet.state_from_snapshot(block)
        assert a.weights.any(), region
        for field in ("weights", "positive", "available", "shed_fraction"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
        assert (a.generation, a.published_at, a.retry_ratio) == (
            b.generation,
            b.published_at,
            b.retry_ratio,
        )
        assert a.tenant_meta == b.tenant_meta == {"tenant_shed": {"acme": 0.25}}


def test_encoded_tables_encode_once_per_generation_cluster_and_format() -> None:
    snap, clusters = full_table()
    cache = EncodedTables()
    declared = REGIONS
    east = cache.encoded(snap, "msgpack", "east", row_clusters=clusters, declared=declared)
    again = cache.encoded(snap, "msgpack", "east", row_clusters=clusters, declared=declared)
    assert again is east and cache.encodes_total == 1
    assert decode_snapshot(east).engine_ids.tolist() == ids(0, 1, 2, 3, 5)
    js = cache.encoded(snap, "json", "east", row_clusters=clusters, declared=declared)
    assert js.startswith(b"{") and decode_snapshot(js).checksum == decode_snapshot(east).checksum
    full = cache.encoded(snap, "msgpack")
    assert decode_snapshot(full).n_classes == snap.n_classes and cache.encodes_total == 3
    assert len(east) < len(full)
    # a new generation drops the old one's encodings
    newer, _ = full_table(generation=8)
    cache.encoded(newer, "msgpack", "west", row_clusters=clusters, declared=declared)
    assert len(cache) == 1 and cache.encodes_total == 4


def test_encoded_tables_are_bounded() -> None:
    snap, clusters = full_table()
    cache = EncodedTables(max_entries=2)
    for region in REGIONS:
        cache.encoded(snap, "msgpack", region, row_clusters=clusters, declared=REGIONS)
    assert len(cache) == 2
    cache.encoded(snap, "msgpack", "west", row_clusters=clusters, declared=REGIONS)
    assert cache.encodes_total == 3  # west was kept (the most recent two)
    cache.encoded(snap, "msgpack", "east", row_clusters=clusters, declared=REGIONS)
    assert cache.encodes_total == 4  # east, the oldest, had gone
    with pytest.raises(ValueError):
        EncodedTables(max_entries=0)


def test_unknown_cluster_names_the_declared_ones_and_a_new_region_gets_an_empty_block() -> None:
    snap, clusters = full_table()
    cache = EncodedTables()
    with pytest.raises(UnknownClusterError, match=r"'mars'.*east, north, west"):
        cache.encoded(snap, "json", "mars", row_clusters=clusters, declared=REGIONS)
    # declared by a reloaded config, not yet in the table in force: flags only, no rows
    data = cache.encoded(snap, "json", "south", row_clusters=clusters, declared=(*REGIONS, "south"))
    block = decode_snapshot(data)
    assert block.n_classes == 0 and block.engine_ids.tolist() == ids(3, 5)
    with pytest.raises(ValueError, match="row clusters"):
        EncodedTables().encoded(snap, "json", "east", row_clusters=clusters[:-1])


def test_the_publisher_keeps_row_clusters_and_writes_the_full_table(shm_name: str) -> None:
    """The local shared-memory table stays whole (proxies of every region may share the host);
    the publisher records each row's cluster with the snapshot."""
    m = model()
    n_g, n_e = len(m.classes), len(m.engine_names)
    pub = TablePublisher(shm_name, lambda: 1.0, republish_after_s=10.0)

    async def main() -> None:
        pub.open(n_e, n_g)
        try:
            await pub.publish(
                m,
                np.full((n_g, n_e), 1.0 / n_e),
                np.zeros(n_g),
                0.1,
                {},
                np.zeros(n_e, dtype=np.uint8),
            )
        finally:
            pub.close()

    asyncio.run(main())
    assert pub.row_clusters == tuple(c.cluster for c in m.classes)
    assert set(pub.row_clusters) == set(REGIONS)
    reader = TableReader(shm_name)
    try:
        local = reader.snapshot()
    finally:
        reader.close()
    assert local.n_classes == n_g and local.n_engines == n_e
