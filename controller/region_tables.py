"""Per-region weight tables: a region's proxies receive only their own rows.

The controller publishes one :class:`~fastroute.tables.TableSnapshot` with every class's row
(classes are ``cluster/model/priority`` for every declared region) × every engine. A proxy uses
only the rows of its own ``proxy.cluster`` (:class:`fastroute.proxy.path.fleet.Fleet`); of the
columns, only engines with weight in those rows or with a flag matter to it, since an engine the
table lacks gets weight 0 in the proxy's rows and stays available — what an unflagged
zero-weight column says. :func:`region_snapshot` cuts that block out of the full snapshot,
keeping generation, publish time, retry ratio and meta (epoch, plan id, tenant entries), so
long-poll, ``after=`` and epoch fencing work unchanged.

:class:`EncodedTables` is the wire cache of ``GET /v1/table``: each (generation, cluster,
format) is sliced and encoded at most once, and only the generation in force is kept.

Slicing the dense snapshot is what the service can do (the planner hands over dense rows);
building the block from the group rows (:func:`controller.weights.region_engine_weights`) costs
about the same per region (bench/bench_plan_scale.py, docs/controller.md "Plan at scale").
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from fastroute.tables import TableSnapshot
from fastroute.tables.wire import encode_snapshot

__all__ = ["EncodedTables", "UnknownClusterError", "cluster_rows", "region_snapshot"]

IntpArray = npt.NDArray[np.intp]

#: Default bound on cached encodings (the generation in force: 2 formats × (regions + 1)).
MAX_CACHED = 512


class UnknownClusterError(KeyError):
    """A cluster that is not declared; the message names the declared ones."""

    def __init__(self, cluster: str, declared: Iterable[str]) -> None:
        names = ", ".join(sorted(declared)) or "none"
        self.message = f"unknown cluster {cluster!r}; declared regions: {names}"
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


def cluster_rows(row_clusters: Sequence[str]) -> dict[str, IntpArray]:
    """Row indices of each cluster, table order.

    Parameters
    ----------
    row_clusters : sequence of str
        The cluster of each table row (``ClassSpec.cluster``).

    Returns
    -------
    dict of str to ndarray of intp
    """
    out: dict[str, list[int]] = {}
    for i, name in enumerate(row_clusters):
        out.setdefault(name, []).append(i)
    return {name: np.array(rows, dtype=np.intp) for name, rows in out.items()}


def region_snapshot(snap: TableSnapshot, rows: npt.ArrayLike) -> TableSnapshot:
    """The block of ``snap`` a region's proxies use: ``rows`` × the engines they may route to.

    Parameters
    ----------
    snap : TableSnapshot
        The full table.
    rows : array_like of int
        The region's class rows (:func:`cluster_rows`); may be empty.

    Returns
    -------
    TableSnapshot
        Those rows (keys, weights, shed fractions) over the engines with weight > 0 in any of
        them or with any flag set (a draining or unavailable engine must still reach the proxy),
        in table order; generation, ``published_at``, retry ratio and meta as in ``snap``;
        checksum of the block.
    """
    idx = np.asarray(rows, dtype=np.intp)
    w = snap.weights[_rows_view(idx)]  # a region's rows are contiguous: a view, no 4 MB copy
    keep = (w > 0).any(axis=0) | (snap.engine_flags != 0)
    cols = np.flatnonzero(keep)
    return TableSnapshot.validated(
        snap.generation,
        snap.engine_ids[cols],
        w[:, cols],
        class_keys=snap.class_keys[idx],
        engine_flags=snap.engine_flags[cols],
        shed_fraction=snap.shed_fraction[idx],
        retry_ratio=snap.retry_ratio,
        published_at=snap.published_at,
        meta=snap.meta_bytes,
    )


def _rows_view(idx: IntpArray) -> slice | IntpArray:
    """``idx`` as a slice when it is a run of consecutive rows (the model orders classes by
    cluster), else itself."""
    if idx.size and idx[-1] - idx[0] + 1 == idx.size and bool(np.all(np.diff(idx) == 1)):
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return idx


class EncodedTables:
    """Wire encodings of the table in force: the full table and each region's block.

    Parameters
    ----------
    max_entries : int
        Most encodings kept; the least recently used goes first. Entries of another generation
        are dropped as soon as a new one is asked for.

    Attributes
    ----------
    encodes_total : int
        Encodings made (a cache miss each).
    """

    def __init__(self, max_entries: int = MAX_CACHED) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self.encodes_total = 0
        self._cache: OrderedDict[tuple[int, str | None, str], bytes] = OrderedDict()
        self._rows: tuple[int, dict[str, IntpArray]] | None = None

    def __len__(self) -> int:
        return len(self._cache)

    def encoded(
        self,
        snap: TableSnapshot,
        fmt: str,
        cluster: str | None = None,
        *,
        row_clusters: Sequence[str] = (),
        declared: Iterable[str] = (),
    ) -> bytes:
        """``snap`` (``cluster`` None) or its block for ``cluster``, encoded as ``fmt``.

        Parameters
        ----------
        snap : TableSnapshot
            The table in force.
        fmt : {"msgpack", "json"}
        cluster : str, optional
            A region: its rows only (:func:`region_snapshot`).
        row_clusters : sequence of str
            The cluster of each row of ``snap`` (read once per generation).
        declared : iterable of str
            Regions of the current config; a declared region without rows in ``snap`` (added
            by a reload not yet planned) gets an empty block, so its proxies keep their
            capacity weights as with the full table.

        Raises
        ------
        UnknownClusterError
            ``cluster`` is neither declared nor a cluster of ``snap``'s rows.
        """
        key = (snap.generation, cluster, fmt)
        data = self._cache.get(key)
        if data is not None:
            self._cache.move_to_end(key)
            return data
        if cluster is None:
            data = encode_snapshot(snap, fmt)
        else:
            rows = self._rows_of(snap, row_clusters)
            declared = set(declared)
            if cluster not in rows and cluster not in declared:
                raise UnknownClusterError(cluster, declared | set(rows))
            empty = np.zeros(0, dtype=np.intp)
            data = encode_snapshot(region_snapshot(snap, rows.get(cluster, empty)), fmt)
        self.encodes_total += 1
        self._store(key, data)
        return data

    def _rows_of(self, snap: TableSnapshot, row_clusters: Sequence[str]) -> dict[str, IntpArray]:
        if self._rows is None or self._rows[0] != snap.generation:
            if len(row_clusters) != snap.n_classes:
                raise ValueError(
                    f"{len(row_clusters)} row clusters for a table of {snap.n_classes} rows"
                )
            self._rows = (snap.generation, cluster_rows(row_clusters))
        return self._rows[1]

    def _store(self, key: tuple[int, str | None, str], data: bytes) -> None:
        for old in [k for k in self._cache if k[0] != key[0]]:
            del self._cache[old]
        self._cache[key] = data
        while len(self._cache) > self.max_entries:
            self._cache.popitem(last=False)
