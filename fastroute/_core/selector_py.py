"""Weighted rendezvous hashing: the pure-Python specification of the compiled selector.

This module is the spec. ``selector.pyx`` implements exactly the same arithmetic in a
``nogil`` loop; any divergence between the two is a bug (uvloop's rule for its
reference implementation), and ``tests/unit/test_selector.py`` checks parity.

Algorithm (Schindelhauer & Schomaker, "Weighted distributed hash tables", SPAA 2005;
logarithmic method, equivalently P-MinHash, Moulton & Jiang, arXiv:1809.04052):

* every engine ``i`` has a seed ``s_i = mix64(engine_id_i XOR 0x9E3779B97F4A7C15)``,
  derived from its stable 64-bit id, never from its list position, so picks do not
  depend on engine order, process or host;
* for a key hash ``k``: ``u_i = ((mix64(k XOR s_i) >> 12) + 0.5) * 2**-52`` in (0, 1)
  and the score is ``-ln(u_i) / w_i``, an Exp(w_i) variate; the engine with the
  **smallest** score wins (an exponential race: engine ``i`` wins with probability
  ``w_i / sum(w)``), ties broken by the smaller engine id;
* ``rank`` orders engines by ``(score, engine id)``: the failover order. Removing an
  engine moves only its keys, each to its runner-up.

Arithmetic, shared bit for bit with the compiled core:

* each weight row is divided by its maximum (``w_i = weight_i / max(row)``, scale
  does not change the race) and ``inv_w_i = 1 / w_i``; weights below
  ``ZERO_WEIGHT_RATIO`` times the row maximum count as zero ("never");
* bound pruning: ``-ln u >= 1 - u``, so an engine whose ``(1 - u) * inv_w`` already
  exceeds the current k-th best score is skipped without calling ``log``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from fastroute._core.selector_tree import (
    LEAST_WALK,
    SCAN_TIES,
    WALK_CAP,
    LoadChunks,
    Tree,
    TreeCache,
    rank_tree,
)

__all__ = ["Selector", "mix64", "engine_seed", "unit_open", "ZERO_WEIGHT_RATIO"]

_MASK64 = 0xFFFFFFFFFFFFFFFF
_SEED_SALT = 0x9E3779B97F4A7C15
#: Weights below this fraction of their row's maximum count as zero. It keeps every
#: score finite (-ln u <= 36.8 for u >= 2**-53).
ZERO_WEIGHT_RATIO = 1e-300


def mix64(z: int) -> int:
    """splitmix64 finaliser (Stafford "Mix13"): a bijection on 64-bit integers."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def engine_seed(engine_id: int) -> int:
    """The rendezvous seed of an engine, from its stable 64-bit id."""
    return mix64(engine_id ^ _SEED_SALT)


def unit_open(h: int) -> float:
    """Map the top 52 hash bits to a double strictly inside (0, 1), exactly.

    52, not 53 bits: ``(2**53 - 1) + 0.5`` is not representable and rounds to
    ``2**53``, which would make ``u == 1`` and the score 0 for one hash in 2**53.
    """
    return (float(h >> 12) + 0.5) * 2.220446049250313e-16


def prepare_weights(engine_ids: Any, weights: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate a table; return ``(ids uint64[n], w float64[c, n], inv_w float64[c, n])``.

    Shared by both implementations so that they normalise identically.
    """
    ids = np.ascontiguousarray(engine_ids, dtype=np.uint64)
    if ids.ndim != 1:
        raise ValueError(f"engine_ids must be 1-D, got shape {ids.shape}")
    if len(np.unique(ids)) != len(ids):
        raise ValueError("engine_ids must be unique")
    w = np.array(weights, dtype=np.float64, order="C", copy=True)
    if w.ndim != 2:
        raise ValueError(f"weights must be 2-D [n_classes, n_engines], got shape {w.shape}")
    if w.shape[1] != ids.shape[0]:
        raise ValueError(
            f"weights has {w.shape[1]} columns but there are {ids.shape[0]} engine ids"
        )
    if not np.all(np.isfinite(w)):
        raise ValueError("weights must be finite (no NaN or inf)")
    if np.any(w < 0):
        raise ValueError("weights must be non-negative")
    if w.shape[1]:
        row_max = w.max(axis=1, keepdims=True)
        np.divide(w, row_max, out=w, where=row_max > 0)
    w[w < ZERO_WEIGHT_RATIO] = 0.0
    with np.errstate(divide="ignore"):
        inv_w = np.where(w > 0, 1.0 / np.where(w > 0, w, 1.0), np.inf)
    return ids, w, np.ascontiguousarray(inv_w)


def _check_key(key_hash: int) -> int:
    if not 0 <= key_hash <= _MASK64:
        raise OverflowError(f"key_hash must be an unsigned 64-bit integer, got {key_hash}")
    return key_hash


class Selector:
    """Weighted rendezvous-hashing engine selector over a weight table (pure Python).

    Parameters
    ----------
    engine_ids : sequence of int
        Stable unsigned 64-bit engine ids (for example ``fastroute.hashing.engine_id(name)``).
    weights : array_like, shape (n_classes, n_engines)
        One row per request class; non-negative and finite; zero means "never".

    Notes
    -----
    The compiled ``fastroute._core.selector.Selector`` has the same API and returns
    the same picks; this class is its specification.
    """

    def __init__(self, engine_ids: Sequence[int] | np.ndarray, weights: Any) -> None:
        ids, w, inv_w = prepare_weights(engine_ids, weights)
        self.n_engines: int = int(ids.shape[0])
        self.n_classes: int = int(w.shape[0])
        self._engine_ids = ids
        self._ids = [int(x) for x in ids]
        self._seeds = [engine_seed(x) for x in self._ids]
        self._w = w.tolist()
        self._inv_w = inv_w.tolist()
        self._index_of = {engine: i for i, engine in enumerate(self._ids)}

    @property
    def engine_ids(self) -> np.ndarray:
        """The engine ids, in table order (read-only)."""
        view = self._engine_ids.view()
        view.flags.writeable = False
        return view

    def eligible_index(self, engine_id: int, row: int, available: Any = None) -> int:
        """The table index of ``engine_id`` if it is eligible in ``row`` (weight > 0, not
        masked out by ``available``), else -1 (also when it is not in the table)."""
        if not 0 <= row < self.n_classes:
            raise IndexError(f"row {row} out of range for {self.n_classes} classes")
        i = self._index_of.get(engine_id, -1)
        if i < 0 or self._inv_w[row][i] == math.inf:
            return -1
        if available is not None and not available[i]:
            return -1
        return i

    def _check(self, key_hash: int, row: int, available: Any) -> list[bool] | None:
        _check_key(key_hash)
        if not 0 <= row < self.n_classes:
            raise IndexError(f"row {row} out of range for {self.n_classes} classes")
        if available is None:
            return None
        mask = np.asarray(available)
        if mask.shape != (self.n_engines,):
            raise ValueError(f"available must have shape ({self.n_engines},), got {mask.shape}")
        return [bool(x) for x in mask]

    def _rank(self, key_hash: int, row: int, mask: list[bool] | None, k: int) -> list[int]:
        inv_w = self._inv_w[row]
        ids = self._ids
        best: list[tuple[float, int, int]] = []  # (score, engine id, index), sorted
        threshold = math.inf
        for i, seed in enumerate(self._seeds):
            iw = inv_w[i]
            if iw == math.inf or (mask is not None and not mask[i]):
                continue
            u = unit_open(mix64(key_hash ^ seed))
            if (1.0 - u) * iw > threshold:
                continue  # bound pruning: -ln u >= 1 - u
            entry = (-math.log(u) * iw, ids[i], i)
            if len(best) == k:
                if entry[:2] >= best[-1][:2]:
                    continue
                best.pop()
            pos = len(best)
            while pos > 0 and entry[:2] < best[pos - 1][:2]:
                pos -= 1
            best.insert(pos, entry)
            if len(best) == k:
                threshold = best[-1][0]
        return [i for _, _, i in best]

    def pick(self, key_hash: int, row: int, available: Any = None) -> int:
        """Return the engine index for ``key_hash`` in class ``row``, or -1 if none.

        Parameters
        ----------
        key_hash : int
            Unsigned 64-bit hash of the routing key (``fastroute.hashing.key_hash``).
        row : int
            Class row of the weight table.
        available : array_like of bool or uint8, shape (n_engines,), optional
            Engines with a false/zero entry are skipped (ejected, unhealthy).

        Returns
        -------
        int
            Index into ``engine_ids``; -1 when no engine of the row has weight > 0
            and is available.
        """
        mask = self._check(key_hash, row, available)
        ranked = self._rank(key_hash, row, mask, 1)
        return ranked[0] if ranked else -1

    def rank(self, key_hash: int, row: int, k: int, available: Any = None) -> list[int]:
        """Return up to ``k`` engine indices in rendezvous (failover) order.

        ``rank(h, row, k)[0] == pick(h, row)``; fewer than ``k`` are returned when
        fewer engines are eligible.
        """
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        mask = self._check(key_hash, row, available)
        return self._rank(key_hash, row, mask, min(k, self.n_engines))

    def pick_bounded(
        self,
        key_hash: int,
        row: int,
        loads: Any,
        balance_factor: float = 2.0,
        available: Any = None,
    ) -> int:
        """Pick with a bounded-load guard (Mirrokni, Thorup, Zadimoghaddam, SODA 2018).

        Walks the rendezvous ranking and returns the first engine whose load stays
        within ``balance_factor`` times its weighted fair share:
        ``loads[e] + 1 <= balance_factor * (total + 1) * w_e / W``, where ``total`` and
        ``W`` sum the loads and weights of the row's eligible engines. If none
        qualifies, the plain pick is returned. Loose factors (about 2) keep KV-cache
        affinity in normal operation and only spill hot keys under overload.

        Parameters
        ----------
        loads : array_like of int64, shape (n_engines,)
            Current load per engine (in-flight requests or tokens).
        balance_factor : float
            ``c >= 1``; default 2.0.
        """
        if not balance_factor >= 1.0:
            raise ValueError(f"balance_factor must be >= 1, got {balance_factor}")
        mask = self._check(key_hash, row, available)
        load = np.asarray(loads)
        if load.shape != (self.n_engines,):
            raise ValueError(f"loads must have shape ({self.n_engines},), got {load.shape}")
        load_list = [int(x) for x in load]
        first = self._rank(key_hash, row, mask, 1)
        if not first:
            return -1
        w = self._w[row]
        eligible = [
            i
            for i in range(self.n_engines)
            if self._inv_w[row][i] != math.inf and (mask is None or mask[i])
        ]
        total_w = 0.0
        total_load = 0
        for i in eligible:
            total_w += w[i]
            total_load += load_list[i]
        scale = balance_factor * float(total_load + 1) / total_w

        def within_bound(i: int) -> bool:
            return float(load_list[i] + 1) <= scale * w[i]

        if within_bound(first[0]):
            return first[0]
        inv_w = self._inv_w[row]
        order = sorted(
            eligible,
            key=lambda i: (
                -math.log(unit_open(mix64(key_hash ^ self._seeds[i]))) * inv_w[i],
                self._ids[i],
            ),
        )
        for i in order:
            if within_bound(i):
                return i
        return first[0]

    def rank_prefix(
        self,
        key_hashes: Sequence[int],
        row: int,
        k: int,
        loads: Any,
        balance_factor: float,
        available: Any = None,
    ) -> tuple[list[int], int]:
        """Rank by the first key whose home engine is within its bounded share.

        The rule of the ``prefix-hrw`` policy (``fastroute/policy/prefix_hrw.py``). Over
        the row's eligible engines ``E``, with ``W = Σ_E w_e`` and ``L = Σ_E loads_e``,
        engine ``e`` is **within bound** iff ``loads_e · W <= c · L · w_e``: its share of
        the load is at most ``c`` times its share of the weight (every engine is within
        bound when ``L = 0``). For ``j = 0, 1, …`` the ranking of ``key_hashes[j]`` is
        returned if its first engine (the key's rendezvous home) is within bound.
        Otherwise the ranking of the last key over the within-bound engines is returned;
        that set is never empty for ``c >= 1`` (the engine of least ``loads_e / w_e``
        is in it), but if rounding empties it the ranking over ``E`` is returned.

        Parameters
        ----------
        key_hashes : sequence of int
            Unsigned 64-bit keys in the order to try, at least one.
        row, k, available
            As :meth:`rank`.
        loads : array_like of int64, shape (n_engines,)
            Load per engine (in-flight tokens or requests).
        balance_factor : float
            ``c >= 1``.

        Returns
        -------
        (list of int, int)
            Up to ``k`` engine indices in failover order, and the position in
            ``key_hashes`` of the key that ranked them (``len(key_hashes)`` for the
            bounded fallback); ``([], -1)`` when no engine is eligible.
        """
        if not balance_factor >= 1.0:
            raise ValueError(f"balance_factor must be >= 1, got {balance_factor}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        keys = [_check_key(h) for h in key_hashes]
        if not keys:
            raise ValueError("key_hashes must not be empty")
        mask = self._check(keys[0], row, available)
        load = np.asarray(loads)
        if load.shape != (self.n_engines,):
            raise ValueError(f"loads must have shape ({self.n_engines},), got {load.shape}")
        load_list = [int(x) for x in load]
        k = min(k, self.n_engines)
        w, inv_w = self._w[row], self._inv_w[row]
        eligible = [
            i for i in range(self.n_engines) if inv_w[i] != math.inf and (mask is None or mask[i])
        ]
        if not eligible:
            return [], -1
        total_w = 0.0
        total_load = 0
        for i in eligible:
            total_w += w[i]
            total_load += load_list[i]

        def within_bound(i: int) -> bool:
            return float(load_list[i]) * total_w <= balance_factor * float(total_load) * w[i]

        for j, key in enumerate(keys):
            ranked = self._rank(key, row, mask, k)
            if within_bound(ranked[0]):
                return ranked, j
        bounded = [False] * self.n_engines
        for i in eligible:
            bounded[i] = within_bound(i)
        ranked = self._rank(keys[-1], row, bounded, k)
        return (ranked or self._rank(keys[-1], row, mask, k)), len(keys)

    def least_loaded(self, key_hash: int, row: int, loads: Any, available: Any = None) -> int:
        """The eligible engine of ``row`` with the smallest load; ties by rendezvous order.

        Eligible as everywhere here: weight > 0 in the row and not masked out. Among the
        engines of least load, the one ``pick(key_hash, row)`` would choose: equal engines
        split such requests by weight instead of all taking the lowest index. Returns -1
        when none is eligible. ``loads`` is int64 per engine.
        """
        mask = self._check(key_hash, row, available)
        load = np.asarray(loads)
        if load.shape != (self.n_engines,):
            raise ValueError(f"loads must have shape ({self.n_engines},), got {load.shape}")
        inv_w = self._inv_w[row]
        eligible = [
            i for i in range(self.n_engines) if inv_w[i] != math.inf and (mask is None or mask[i])
        ]
        if not eligible:
            return -1
        least = min(int(load[i]) for i in eligible)
        ties = [False] * self.n_engines
        for i in eligible:
            ties[i] = int(load[i]) == least
        return self._rank(key_hash, row, ties, 1)[0]

    # -- hierarchical rendezvous (selector_tree: its spec) ---------------------------

    def _tree(self, row: int, mask: list[bool] | None) -> tuple[Tree, LoadChunks]:
        trees = self.__dict__.get("_trees")
        if trees is None:
            trees = self._trees = TreeCache()
        return trees.get(row, mask, self._seeds, self._w[row], self._inv_w[row])

    def tree_size(self, row: int, available: Any = None) -> int:
        """How many engines of ``row`` are eligible (weight > 0, not masked out)."""
        mask = self._check(0, row, available)
        return self._tree(row, mask)[0].m

    def tree_rank(self, key_hash: int, row: int, k: int, available: Any = None) -> list[int]:
        """Up to ``k`` engine indices in hierarchical rendezvous order (``selector_tree``).

        Same long-run shares as :meth:`rank`, O(16 log16 n) hashes per position.
        """
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        mask = self._check(key_hash, row, available)
        tree, _ = self._tree(row, mask)
        return rank_tree(tree, key_hash, k, self._seeds, self._w[row], self._inv_w[row], self._ids)

    def _loads(self, loads: Any) -> np.ndarray:
        load = np.asarray(loads)
        if load.shape != (self.n_engines,):
            raise ValueError(f"loads must have shape ({self.n_engines},), got {load.shape}")
        return load

    def tree_rank_prefix(
        self,
        key_hashes: Sequence[int],
        row: int,
        k: int,
        loads: Any,
        balance_factor: float,
        available: Any = None,
        home_slack: int = 0,
    ) -> tuple[list[int], int]:
        """:meth:`rank_prefix` on the tree ranking, with the load total of bounded
        staleness of ``selector_tree.LoadChunks``.

        The first key's home is within bound iff ``(load - home_slack) * W <= c * total *
        w`` (``home_slack >= 0``, in load units: what staying there is worth); the other
        keys' homes and the fallback use the plain bound. The bounded fallback is the
        first ``k`` within-bound engines of the last key's tree ranking among its first
        ``WALK_CAP`` positions (the last key's ranking over every eligible engine if none
        is).
        """
        if not balance_factor >= 1.0:
            raise ValueError(f"balance_factor must be >= 1, got {balance_factor}")
        if home_slack < 0:
            raise ValueError(f"home_slack must be >= 0, got {home_slack}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        keys = [_check_key(h) for h in key_hashes]
        if not keys:
            raise ValueError("key_hashes must not be empty")
        mask = self._check(keys[0], row, available)
        load = self._loads(loads)
        tree, chunks = self._tree(row, mask)
        if tree.m == 0:
            return [], -1
        total_load = chunks.refresh(load)
        w, inv_w, seeds, ids = self._w[row], self._inv_w[row], self._seeds, self._ids
        total_w = tree.total_w
        limit = balance_factor * float(total_load)

        def within_bound(i: int, slack: int = 0) -> bool:
            return float(int(load[i]) - slack) * total_w <= limit * w[i]

        for j, key in enumerate(keys):
            first = rank_tree(tree, key, 1, seeds, w, inv_w, ids)
            if within_bound(first[0], home_slack if j == 0 else 0):
                return rank_tree(tree, key, k, seeds, w, inv_w, ids), j
        ranked = rank_tree(tree, keys[-1], k, seeds, w, inv_w, ids, within_bound, WALK_CAP)
        return (ranked or rank_tree(tree, keys[-1], k, seeds, w, inv_w, ids)), len(keys)

    def tree_within_bound(
        self,
        index: int,
        row: int,
        loads: Any,
        balance_factor: float,
        available: Any = None,
        slack: int = 0,
    ) -> bool:
        """Whether engine ``index`` is within :meth:`tree_rank_prefix`'s load bound, its
        load less ``slack``: ``(load - slack) * W <= c * total * w``, ``total`` the tree's
        load total as of its last ranking (of this decision; read whole on a first call)."""
        mask = self._check(0, row, available)
        load = self._loads(loads)
        tree, chunks = self._tree(row, mask)
        limit = balance_factor * float(chunks.total(load))
        return float(int(load[index]) - slack) * tree.total_w <= limit * self._w[row][index]

    def tree_least_loaded(self, key_hash: int, row: int, loads: Any, available: Any = None) -> int:
        """The cost spill's least-loaded engine (``selector_tree``: the least live load
        among the load chunks' least-load engines, or, when at least ``SCAN_TIES`` of them
        tie there, an engine as light among the key's first ``LEAST_WALK`` ranked ones);
        -1 if none is eligible."""
        mask = self._check(key_hash, row, available)
        load = self._loads(loads)
        tree, chunks = self._tree(row, mask)
        if not chunks.scanned:
            chunks.refresh(load)
        inv_w, best_i, best_load, best, n_at = self._inv_w[row], -1, 0, math.inf, 0
        for ties in chunks.ties:
            for i in ties:
                li = int(load[i])
                if best_i >= 0 and li > best_load:
                    continue
                n_at = 1 if best_i < 0 or li < best_load else n_at + 1
                s = -math.log(unit_open(mix64(key_hash ^ self._seeds[i]))) * inv_w[i]
                if (
                    best_i < 0
                    or li < best_load
                    or s < best
                    or (s == best and self._ids[i] < self._ids[best_i])
                ):
                    best_i, best_load, best = i, li, s
        if n_at >= SCAN_TIES:  # many ties, perhaps more than the chunks kept: walk
            walked = rank_tree(
                tree,
                key_hash,
                1,
                self._seeds,
                self._w[row],
                inv_w,
                self._ids,
                lambda i: int(load[i]) <= best_load,
                LEAST_WALK,
            )
            if walked:
                return walked[0]
        return best_i
