"""Exact aggregation of engines into groups for the routing LP.

Algorithm (docs/controller.md, docs/algorithms.md §1.7). Engines with the same latency
*shape* (same grid and PWL slopes, :meth:`LatencyProfile.shape_key`), the same network-distance
vector to every class and the same eligibility set are interchangeable except for their capacity.
For members of effective capacity ``C_i = cap_i · h_i`` carrying a total load ``Λ``, the latency
rate ``Σ_i C_i φ(λ_i / C_i)`` is minimised at equal utilisation ``λ_i = Λ · C_i / Σ C_j`` (Jensen on
the perspective function), where it equals ``C φ(Λ / C)`` with ``C = Σ C_i``. Hence a group
is one LP engine with capacity ``Σ C_i h_i``, the common slopes and summed segment widths, and
the optimal split inside it is proportional to effective capacity (:func:`split_group`). The
grouped LP therefore has the same optimum as the ungrouped one.

Health derating changes only ``h_i`` and keeps the engine in its group; a different shape
(re-profiled anomaly, other hardware) makes a different group. An engine with ``h_i = 0`` stays a
member with zero share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from controller.latency import LatencyProfile

__all__ = ["EngineGroups", "engine_locations", "group_engines", "regroup_rates", "split_group"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.intp]


def split_group(x_group_rps: npt.ArrayLike, member_capacity_rps: npt.ArrayLike) -> FloatArray:
    """Split group allocations over members in proportion to effective capacity.

    Parameters
    ----------
    x_group_rps : array_like, shape (n_classes,) or scalar
        Rate each class sends to the group.
    member_capacity_rps : array_like, shape (n_members,)
        Effective capacity ``C_i · h_i`` of each member (≥ 0).

    Returns
    -------
    ndarray, shape (n_classes, n_members) (or (n_members,) for a scalar)
        Per-member rates; all zeros when the group has no capacity.
    """
    x = np.asarray(x_group_rps, dtype=np.float64)
    cap = np.asarray(member_capacity_rps, dtype=np.float64)
    if cap.ndim != 1 or np.any(~np.isfinite(cap)) or np.any(cap < 0):
        raise ValueError("member_capacity_rps must be a 1-D array of finite values >= 0")
    total = cap.sum()
    share = cap / total if total > 0 else np.zeros_like(cap)
    return np.multiply.outer(x, share)


@dataclass(frozen=True, eq=False)
class EngineGroups:
    """A partition of engines into LP groups and the grouped LP data.

    Attributes
    ----------
    group_of_engine : ndarray of intp, shape (n_engines,)
        Group index of every engine.
    members : tuple of ndarray of intp
        Engine indices of each group, ascending.
    engine_capacity_rps : ndarray, shape (n_engines,)
        Effective capacity ``cap · h`` of every engine.
    capacity_rps : ndarray, shape (n_groups,)
        ``Σ cap_i · h_i`` over each group's members.
    profiles : tuple of LatencyProfile
        One representative profile per group (all members share its shape).
    eligible : ndarray of bool, shape (n_classes, n_groups)
        Class × group eligibility (that of any member).
    network_latency_s : ndarray, shape (n_classes, n_groups)
        Class → group network latency (that of any member).
    location_of_engine : ndarray of intp, shape (n_engines,) or None
        :func:`engine_locations` of the matrices the partition was built from.
    """

    group_of_engine: IntArray
    members: tuple[IntArray, ...]
    engine_capacity_rps: FloatArray
    capacity_rps: FloatArray
    profiles: tuple[LatencyProfile, ...]
    eligible: npt.NDArray[np.bool_]
    network_latency_s: FloatArray
    location_of_engine: IntArray | None = None

    @property
    def n_groups(self) -> int:
        """Number of groups."""
        return len(self.members)

    def with_health(self, capacity_rps: npt.ArrayLike, health: npt.ArrayLike) -> EngineGroups:
        """The same partition with members derated to ``capacity_rps · health``.

        Health is not part of the grouping key (module doc), so a derating change keeps every
        group and only its capacity moves; this skips the O(classes × engines) key build of
        :func:`group_engines` and gives the same groups it would.
        """
        cap = np.asarray(capacity_rps, dtype=np.float64)
        h = np.asarray(health, dtype=np.float64)
        if cap.shape != self.engine_capacity_rps.shape or h.shape != cap.shape:
            n = self.engine_capacity_rps.size
            raise ValueError(f"capacity_rps and health must both have the {n} engines' entries")
        if np.any(~np.isfinite(cap)) or np.any(cap < 0) or np.any((h < 0) | (h > 1)):
            raise ValueError("capacity_rps must be finite >= 0 and health within [0, 1]")
        eff = cap * h
        return replace(
            self,
            engine_capacity_rps=eff,
            capacity_rps=np.bincount(self.group_of_engine, eff, self.n_groups),
        )

    def split(self, x_group_rps: npt.ArrayLike) -> FloatArray:
        """Engine-level rates ``(n_classes, n_engines)`` from group rates ``(n_classes, n_groups)``.

        Each group's column is split over its members ∝ effective capacity (:func:`split_group`).
        """
        xg = np.asarray(x_group_rps, dtype=np.float64)
        if xg.ndim != 2 or xg.shape[1] != self.n_groups:
            raise ValueError(f"expected (n_classes, {self.n_groups}) group rates, got {xg.shape}")
        gcap = self.capacity_rps[self.group_of_engine]
        share = np.divide(self.engine_capacity_rps, gcap, out=np.zeros_like(gcap), where=gcap > 0)
        return xg[:, self.group_of_engine] * share


def group_engines(
    profiles: Sequence[LatencyProfile],
    capacity_rps: npt.ArrayLike,
    eligible: npt.ArrayLike,
    network_latency_s: npt.ArrayLike,
    *,
    health: npt.ArrayLike | None = None,
    decimals: int = 9,
    location_of_engine: npt.ArrayLike | None = None,
) -> EngineGroups:
    """Partition engines by (shape, network-distance vector, eligibility set).

    Parameters
    ----------
    profiles : sequence of LatencyProfile, length n_engines
        Each engine's profile; engines may share profile objects.
    capacity_rps : array_like, shape (n_engines,)
        Nominal capacity (rate at ρ = 1, in the demand's units).
    eligible : array_like of bool, shape (n_classes, n_engines)
        Which classes may use which engines.
    network_latency_s : array_like, shape (n_classes, n_engines)
        Class → engine network latency (s); only eligible entries matter.
    health : array_like, shape (n_engines,), optional
        Derating factors ``h ∈ [0, 1]``; default all 1.
    decimals : int
        Rounding of slopes and latencies when comparing them (exact ties are the norm: they come
        from the same region pair or the same profile).
    location_of_engine : array_like of int, shape (n_engines,), optional
        :func:`engine_locations` of ``eligible`` and ``network_latency_s`` (e.g. the previous
        partition's, when only profiles changed); computed when not given.

    Returns
    -------
    EngineGroups
        Groups in order of their first engine.
    """
    cap = np.asarray(capacity_rps, dtype=np.float64)
    n_engines = cap.size
    h = np.ones(n_engines) if health is None else np.asarray(health, dtype=np.float64)
    elig = np.asarray(eligible, dtype=bool)
    dist = np.asarray(network_latency_s, dtype=np.float64)
    if len(profiles) != n_engines or h.shape != cap.shape or cap.ndim != 1:
        raise ValueError("profiles, capacity_rps and health must all have n_engines entries")
    if elig.ndim != 2 or elig.shape[1] != n_engines or dist.shape != elig.shape:
        raise ValueError("eligible and network_latency_s must be (n_classes, n_engines)")
    if np.any(~np.isfinite(cap)) or np.any(cap < 0) or np.any((h < 0) | (h > 1)):
        raise ValueError("capacity_rps must be finite >= 0 and health within [0, 1]")

    shape_ids: dict[tuple[float, ...], int] = {}
    shape_of_engine = np.empty(n_engines, dtype=np.intp)
    shape_profile: list[LatencyProfile] = []
    by_object: dict[int, int] = {}
    for i, prof in enumerate(profiles):
        sid = by_object.get(id(prof))
        if sid is None:
            key = prof.shape_key(decimals)
            sid = shape_ids.setdefault(key, len(shape_ids))
            if sid == len(shape_profile):
                shape_profile.append(prof)
            by_object[id(prof)] = sid
        shape_of_engine[i] = sid
    if location_of_engine is None:
        location_of_engine = engine_locations(elig, dist, decimals)
    elif np.shape(location_of_engine) != (n_engines,):
        raise ValueError(f"location_of_engine must have {n_engines} entries")
    # the key is (shape, location); groups are numbered by first appearance
    index_of_key: dict[tuple[int, int], int] = {}
    group_of_engine = np.fromiter(
        (
            index_of_key.setdefault(key, len(index_of_key))
            for key in zip(shape_of_engine.tolist(), location_of_engine.tolist(), strict=True)
        ),
        dtype=np.intp,
        count=n_engines,
    )
    n_groups = len(index_of_key)
    reps = np.full(n_groups, n_engines, dtype=np.intp)
    np.minimum.at(reps, group_of_engine, np.arange(n_engines))
    eff = cap * h
    sort_idx = np.argsort(group_of_engine, kind="stable")
    bounds = np.searchsorted(group_of_engine[sort_idx], np.arange(n_groups + 1))
    members = tuple(sort_idx[bounds[j] : bounds[j + 1]] for j in range(n_groups))
    return EngineGroups(
        group_of_engine=group_of_engine,
        members=members,
        engine_capacity_rps=eff,
        capacity_rps=np.bincount(group_of_engine, eff, n_groups),
        profiles=tuple(shape_profile[int(shape_of_engine[r])] for r in reps),
        eligible=elig[:, reps],
        network_latency_s=dist[:, reps],
        location_of_engine=np.asarray(location_of_engine, dtype=np.intp),
    )


def engine_locations(
    eligible: npt.ArrayLike, network_latency_s: npt.ArrayLike, decimals: int = 9
) -> IntArray:
    """Number engines by (eligibility set, network-distance vector), by first appearance.

    The shape-free part of the grouping key: it depends only on the classes × engines matrices,
    which stay fixed while profiles are refitted, so :func:`group_engines` can take it from the
    previous partition (``location_of_engine``) instead of re-hashing ``2 · n_classes`` values
    per engine.
    """
    elig = np.asarray(eligible, dtype=bool)
    dist = np.asarray(network_latency_s, dtype=np.float64)
    elig_rows = np.ascontiguousarray(elig.T)
    dist_rows = np.ascontiguousarray((np.round(np.where(elig, dist, 0.0), decimals) + 0.0).T)
    # hashing row bytes is ~50x faster than np.unique(axis=0) for thousands of engines
    index_of_key: dict[bytes, int] = {}
    return np.fromiter(
        (
            index_of_key.setdefault(e.tobytes() + d.tobytes(), len(index_of_key))
            for e, d in zip(elig_rows, dist_rows, strict=True)
        ),
        dtype=np.intp,
        count=elig.shape[1],
    )


def regroup_rates(x_group_rps: npt.ArrayLike, old: EngineGroups, new: EngineGroups) -> FloatArray:
    """Group rates of partition ``old`` re-expressed over partition ``new`` (same engines).

    Each old group's rate is split over its members ∝ effective capacity, then summed per new
    group, so the total per class is kept. Used to carry the LP anchor over a regrouping
    (a refitted profile splitting or merging groups).
    """
    if old.group_of_engine.shape != new.group_of_engine.shape:
        raise ValueError("both partitions must cover the same engines")
    x_eng = old.split(x_group_rps)
    out = np.zeros((x_eng.shape[0], new.n_groups))
    np.add.at(out.T, new.group_of_engine, x_eng.T)
    return out
