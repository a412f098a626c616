"""Hierarchical weighted rendezvous over a hash trie: the spec of the compiled tree.

Flat weighted rendezvous (``selector_py``) hashes every eligible engine per key: O(n).
This module ranks with O(f · log_f n) hashes (Wang & Ravishankar, "Skeleton-based
hierarchical rendezvous hashing", 2009: weighted rendezvous at each level of a virtual
tree whose node weight is the sum of its subtree's weights), keeping the long-run
shares of flat weighted rendezvous exactly: at every level a child wins with
probability ``W_child / W_node`` (an exponential race), so an engine wins with
probability ``Π W_child / W_node = w_e / W``.

The tree (one per weight row and eligibility mask; :func:`build_tree`, shared by both
implementations so that they build the same tree bit for bit)
    The row's eligible engines ``E`` (weight > 0 and not masked out) are the leaves of a
    trie over their **path hashes** ``p_e = mix64(seed_e XOR TREE_SALT)`` (``seed_e``
    the engine's rendezvous seed, from its stable id): a node of depth ``d`` holds the
    engines whose top ``4d`` bits of ``p_e`` are its prefix ``P``. A node with at most
    :data:`LEAF_CAP` engines (or at depth 16) is a **bucket**; otherwise its children
    are the non-empty prefixes ``16 P + digit``, digit = the next 4 bits (fanout 16).
    The shape depends only on the set ``E``, never on table order, so every process
    builds the same tree, and an engine's removal changes only its own path (and, when
    a node on it falls to :data:`LEAF_CAP` engines, that node becomes a bucket).
    ``W_node`` sums the subtree's normalised weights (buckets in trie order, internal
    nodes over their children in digit order).

Descent of key ``k``
    At an internal node, child ``c`` (seed ``s_c = mix64(P_c XOR mix64(d_c XOR
    NODE_SALT))``) scores ``-ln(u_c) / W_c`` with ``u_c = unit_open(mix64(k XOR s_c))``;
    the smallest score wins, ties by the smaller seed. In a bucket the members race as
    in flat rendezvous (``-ln(u_e) / w_e``, ties by engine id). The bound pruning of
    flat rendezvous applies at every level (``-ln u >= 1 - u``).

Ranking (failover order)
    ``rank[0]`` is the descent; ``rank[j]`` is the descent with ``rank[0..j-1]`` removed
    (their weights subtracted from every node on their paths, emptied nodes skipped):
    exactly where the key goes if the engines before it fail, as in flat rendezvous.

Minimal disruption
    Removing engine ``e`` raises the scores of the nodes on its path only, so a key
    moves only if its descent passed through one of them: the keys homed on ``e``
    (share ``w_e / W``) plus, per level, keys that now prefer a sibling subtree,
    about ``w_e / W`` per internal level (``ceil(log16(n / LEAF_CAP))``: 2 at 1,000
    engines, 3 at 10,000), and the keys of a node that became a bucket.
    ``tests/unit/test_selector_tree.py`` measures it.

Load totals with bounded staleness (:class:`LoadChunks`)
    The load bound needs ``L = Σ_E L_e``. The eligible engines, in trie order, are cut
    into chunks of :data:`LOAD_CHUNK`; each call re-reads one chunk (round robin) and
    ``L`` sums the chunks' last sums; a tree's first call reads them all. With
    ``n <= LOAD_CHUNK`` that is every engine every call (exact); at ``n`` engines a
    chunk is at most ``ceil(n / LOAD_CHUNK) - 1`` calls old (39 at 10,000). The engine
    loads ``L_e`` that the bound compares are always read live. The least-loaded engine
    (the cost spill's target): ``L*`` is the least *live* load among the chunks'
    least-load engines as of their last read (up to :data:`SCAN_TIES` per chunk), and the
    answer is the one of them at ``L*`` of least flat rendezvous score for the key; but
    when at least :data:`SCAN_TIES` of them are at ``L*`` (perhaps more ties than the
    chunks kept: an idle part of the fleet), the first of the key's first
    :data:`LEAST_WALK` ranked engines whose live load is at most ``L*``, if any, so that
    such requests spread over all the ties by weight.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = [
    "LEAF_CAP",
    "LEAST_WALK",
    "LOAD_CHUNK",
    "SCAN_TIES",
    "TREE_CACHE",
    "WALK_CAP",
    "LoadChunks",
    "Tree",
    "TreeCache",
    "build_tree",
    "rank_tree",
]

_MASK64 = 0xFFFFFFFFFFFFFFFF
#: Salts of the path hash and of the node seeds (any odd constants; fixed forever:
#: changing one moves every key).
TREE_SALT = 0xD6E8FEB86659FD93
NODE_SALT = 0xA0761D6478BD642F
#: Bits per trie level: fanout 16.
FANOUT_BITS = 4
#: A node of at most this many engines is a bucket (flat rendezvous among them).
LEAF_CAP = 16
#: Deepest node: 64 path bits / FANOUT_BITS.
MAX_DEPTH = 64 // FANOUT_BITS
#: Engines per load chunk (one chunk is re-read per call).
LOAD_CHUNK = 256
#: Least-load ties a chunk keeps (as ``selector.pxd`` ``SCAN_TIES``).
SCAN_TIES = 8
#: Trees a selector caches (by row and mask contents); all are dropped when full.
TREE_CACHE = 8
#: Ranking positions the bounded fallback walks looking for within-bound engines. At
#: least a ``1 - 1/c`` weight share is within bound (the over-bound engines carry more
#: than ``c`` times their weight share of a total of 1), so for ``c = 2`` a position is
#: within bound with probability >= 1/2 and 64 positions all miss with < 1e-19.
WALK_CAP = 64
#: Ranking positions the least-loaded choice walks for an engine at the least load: when
#: many engines tie there (an idle part of the fleet) the key's own ranking spreads the
#: requests over them by weight, as flat rendezvous over the ties did.
LEAST_WALK = 8


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _unit_open(h: int) -> float:
    return (float(h >> 12) + 0.5) * 2.220446049250313e-16


def path_hash(seed: int) -> int:
    """An engine's position in the trie, from its rendezvous seed."""
    return _mix64(seed ^ TREE_SALT)


def node_seed(depth: int, prefix: int) -> int:
    """The rendezvous seed of the trie node of ``depth`` and path ``prefix``."""
    return _mix64(prefix ^ _mix64(depth ^ NODE_SALT))


class Tree:
    """The trie of one (row, mask), as flat arrays (see the module).

    Attributes
    ----------
    order : ndarray of int64, shape (m,)
        The eligible engines' indices in trie order (ascending path hash).
    node_w : ndarray of float64
        Subtree weight per node (node 0 is the root).
    node_count : ndarray of int64
        Engines per subtree.
    node_seed : ndarray of uint64
        Rendezvous seed per node.
    node_first, node_n : ndarray of int64
        Internal node: its children are nodes ``node_first .. node_first + node_n - 1``;
        bucket: its engines are ``order[node_first : node_first + node_n]``.
    node_bucket : ndarray of uint8
        1 for a bucket.
    """

    def __init__(self, order: list[int], nodes: list[list[Any]]) -> None:
        self.order = np.array(order, dtype=np.int64)
        self.m = len(order)
        self.node_w = np.array([x[0] for x in nodes], dtype=np.float64)
        self.node_count = np.array([x[1] for x in nodes], dtype=np.int64)
        self.node_seed = np.array([x[2] for x in nodes], dtype=np.uint64)
        self.node_first = np.array([x[3] for x in nodes], dtype=np.int64)
        self.node_n = np.array([x[4] for x in nodes], dtype=np.int64)
        self.node_bucket = np.array([x[5] for x in nodes], dtype=np.uint8)
        self.total_w = float(self.node_w[0]) if nodes else 0.0
        self.n_chunks = -(-self.m // LOAD_CHUNK)

    @classmethod
    def from_arrays(cls, order: np.ndarray, nodes: list[list[Any]]) -> Tree:
        """A tree from its engine order (int64 array) and its node rows ``[W, count,
        seed, first, n, bucket]`` (the compiled builder's output)."""
        tree = cls([], nodes)
        tree.order = order
        tree.m = len(order)
        tree.n_chunks = -(-tree.m // LOAD_CHUNK)
        return tree


def build_tree(seeds: list[int], w_row: list[float], eligible: list[int]) -> Tree:
    """The trie over the engines ``eligible`` (indices, weight > 0) of one row.

    O(n log n), once per table and mask. The compiled selector builds the same tree in C
    (``selector.pyx`` ``_build_tree``: 0.2 ms at 1,000 engines, 3 ms at 10,000).
    """
    paths = {i: path_hash(seeds[i]) for i in eligible}
    order = sorted(eligible, key=paths.__getitem__)
    keys = [paths[i] for i in order]
    # nodes[q] = [W, count, seed, first, n, bucket, start, stop, depth, prefix], breadth
    # first so that a node's children are consecutive.
    nodes: list[list[Any]] = []
    if order:
        nodes.append([0.0, len(order), 0, 0, 0, 0, 0, len(order), 0, 0])
    q = 0
    while q < len(nodes):
        node = nodes[q]
        start, stop, depth, prefix = node[6], node[7], node[8], node[9]
        if stop - start <= LEAF_CAP or depth == MAX_DEPTH:
            total = 0.0
            for pos in range(start, stop):
                total += w_row[order[pos]]
            node[0], node[3], node[4], node[5] = total, start, stop - start, 1
        else:
            shift = 64 - FANOUT_BITS * (depth + 1)
            node[3] = len(nodes)
            pos = start
            while pos < stop:
                digit = (keys[pos] >> shift) & ((1 << FANOUT_BITS) - 1)
                end = pos
                while end < stop and (keys[end] >> shift) & ((1 << FANOUT_BITS) - 1) == digit:
                    end += 1
                child = (prefix << FANOUT_BITS) | digit
                nodes.append(
                    [
                        0.0,
                        end - pos,
                        node_seed(depth + 1, child),
                        0,
                        0,
                        0,
                        pos,
                        end,
                        depth + 1,
                        child,
                    ]
                )
                pos = end
            node[4] = len(nodes) - node[3]
        q += 1
    for node in reversed(nodes):  # children after parents: sum bottom-up
        if not node[5]:
            total = 0.0
            for c in range(node[3], node[3] + node[4]):
                total += nodes[c][0]
            node[0] = total
    return Tree(order, nodes)


class LoadChunks:
    """Per-chunk load sums and least-load engines of one tree (see the module)."""

    def __init__(self, tree: Tree) -> None:
        self.order = [int(x) for x in tree.order]
        self.n_chunks = tree.n_chunks
        self.sums = [0] * self.n_chunks
        self.least = [0] * self.n_chunks
        self.ties: list[list[int]] = [[] for _ in range(self.n_chunks)]
        self.cursor = 0
        self.scanned = False

    def _scan(self, j: int, load: Any) -> None:
        total, least, ties = 0, 0, []
        for pos in range(j * LOAD_CHUNK, min((j + 1) * LOAD_CHUNK, len(self.order))):
            i = self.order[pos]
            li = int(load[i])
            total += li
            if not ties or li < least:
                least, ties = li, [i]
            elif li == least and len(ties) < SCAN_TIES:
                ties.append(i)
        self.sums[j], self.least[j], self.ties[j] = total, least, ties

    def total(self, load: Any) -> int:
        """The total load as of the last :meth:`refresh` (which this is on the first call)."""
        return sum(self.sums) if self.scanned else self.refresh(load)

    def refresh(self, load: Any) -> int:
        """Re-read one chunk (all on the first call); the total load."""
        if not self.scanned:
            for j in range(self.n_chunks):
                self._scan(j, load)
            self.scanned = True
        elif self.n_chunks:
            self._scan(self.cursor, load)
            self.cursor = (self.cursor + 1) % self.n_chunks
        return sum(self.sums)


class TreeCache:
    """The trees of one selector, by row and mask contents, with their load chunks."""

    def __init__(self) -> None:
        # (row, mask bytes or None) -> (tree, chunks)
        self._entries: dict[tuple[int, bytes | None], tuple[Tree, LoadChunks]] = {}

    def get(
        self,
        row: int,
        mask: list[bool] | None,
        seeds: list[int],
        w_row: list[float],
        inv_w_row: list[float],
    ) -> tuple[Tree, LoadChunks]:
        key = (row, None if mask is None else bytes(bytearray(mask)))
        hit = self._entries.get(key)
        if hit is None:
            eligible = [
                i
                for i in range(len(seeds))
                if inv_w_row[i] != math.inf and (mask is None or mask[i])
            ]
            tree = build_tree(seeds, w_row, eligible)
            hit = (tree, LoadChunks(tree))
            if len(self._entries) >= TREE_CACHE:
                self._entries.clear()
            self._entries[key] = hit
        return hit


def rank_tree(
    tree: Tree,
    key: int,
    k: int,
    seeds: list[int],
    w_row: list[float],
    inv_w_row: list[float],
    ids: list[int],
    accept: Any = None,
    cap: int | None = None,
) -> list[int]:
    """The first ``k`` engines of ``key``'s tree ranking (see the module) for which
    ``accept(i)`` holds (all when ``accept`` is None), walking at most ``cap``
    positions of the ranking (all when None)."""
    node_w, node_count, node_seeds = tree.node_w, tree.node_count, tree.node_seed
    node_first, node_n, node_bucket, order = (
        tree.node_first,
        tree.node_n,
        tree.node_bucket,
        tree.order,
    )
    removed_w: dict[int, float] = {}
    removed_n: dict[int, int] = {}
    removed: set[int] = set()
    out: list[int] = []
    limit = tree.m if cap is None else min(cap, tree.m)
    for _ in range(limit):
        if len(out) == k:
            break
        q, path = 0, [0]
        while not node_bucket[q]:
            best, best_c = math.inf, -1
            for c in range(int(node_first[q]), int(node_first[q] + node_n[q])):
                if int(node_count[c]) - removed_n.get(c, 0) == 0:
                    continue
                wc = float(node_w[c]) - removed_w.get(c, 0.0)
                if not wc > 0.0:
                    wc = 5e-324
                seed = int(node_seeds[c])
                u = _unit_open(_mix64(key ^ seed))
                if (1.0 - u) / wc > best:
                    continue  # -ln u >= 1 - u: this child cannot win
                s = -math.log(u) / wc
                if best_c < 0 or s < best or (s == best and seed < int(node_seeds[best_c])):
                    best, best_c = s, c
            q = best_c
            path.append(q)
        best, best_i = math.inf, -1
        for pos in range(int(node_first[q]), int(node_first[q] + node_n[q])):
            i = int(order[pos])
            if i in removed:
                continue
            u = _unit_open(_mix64(key ^ seeds[i]))
            iw = inv_w_row[i]
            if (1.0 - u) * iw > best:
                continue
            s = -math.log(u) * iw
            if best_i < 0 or s < best or (s == best and ids[i] < ids[best_i]):
                best, best_i = s, i
        removed.add(best_i)
        w_i = w_row[best_i]
        for node in path:
            removed_w[node] = removed_w.get(node, 0.0) + w_i
            removed_n[node] = removed_n.get(node, 0) + 1
        if accept is None or accept(best_i):
            out.append(best_i)
    return out
