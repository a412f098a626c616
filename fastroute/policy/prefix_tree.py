"""An approximate, multi-tenant radix tree of routed prompt prefixes (bytes).

The data structure behind the ``cache-aware`` policy: a guess, from routing history
alone, of which prompt prefixes each engine's KV cache holds (SGLang
``sgl-router/src/policies/tree.rs``; read for the idea, written from scratch).

Structure
    One compressed trie (radix tree) over byte strings shared by all tenants (engines,
    identified by their stable 64-bit ids). Each edge is labelled with a non-empty
    byte string; children are keyed by the first byte of their label. Every node
    records which tenants hold it and when each last used it (a logical clock, one
    tick per insert: no wall clock, so runs are reproducible). Sharing one tree makes a
    lookup a single walk for all engines instead of one walk per engine.

Invariants (checked by ``_check`` in the tests)
    * a tenant that holds a node holds all its ancestors (its prefixes);
    * ``size(t)`` is the total length in bytes of the labels of the nodes ``t`` holds:
      the number of distinct prefix bytes routed to ``t`` (shared prefixes counted
      once per tenant);
    * after :meth:`insert` returns, ``size(t) <= max_bytes`` for the inserting tenant
      (other tenants never grow during someone else's insert);
    * nodes no tenant holds are removed.

Eviction
    Least recently used **leaves first**, per tenant: when an insert pushes a tenant
    over ``max_bytes``, the tenant's least recently used leaf (a node it holds whose
    children it does not hold) is released, repeatedly, until it fits. Releasing a
    leaf may turn its parent into a leaf, which is then ordered by its own last use.
    Per tenant, a heap of ``(tick, seq, node)`` with lazy deletion (entries whose tick
    no longer matches are skipped) and a set of current leaves, from which the heap is
    rebuilt when stale entries outnumber live ones. SGLang evicts from a background
    thread on a timer; here eviction is inline and amortised, so memory is bounded at
    every instant and no thread is needed.

Cost
    ``insert`` and ``match``: O(len(data)) byte comparisons done in C (``startswith``
    and an XOR of big integers for the first differing byte) plus O(tenants per node)
    per node on the path; eviction O(log leaves) per released leaf, amortised.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

__all__ = ["PrefixTree", "common_prefix_len"]


def common_prefix_len(a: bytes, b: bytes, start: int = 0) -> int:
    """Length of the common prefix of ``a`` and ``b[start:]`` (computed in C)."""
    m = min(len(a), len(b) - start)
    if m <= 0:
        return 0
    x = int.from_bytes(a[:m], "big") ^ int.from_bytes(b[start : start + m], "big")
    if x == 0:
        return m
    # The most significant differing bit lies in byte m - ceil(bit_length / 8).
    return m - (x.bit_length() + 7) // 8


class _Node:
    __slots__ = ("text", "parent", "children", "access", "held_children")

    def __init__(self, text: bytes, parent: _Node | None) -> None:
        self.text = text
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.access: dict[int, int] = {}  # tenant -> tick of last use
        self.held_children: dict[int, int] = {}  # tenant -> children it holds


class PrefixTree:
    """A shared radix tree of byte prefixes with per-tenant size bound and LRU eviction.

    Parameters
    ----------
    max_bytes : int
        Per-tenant bound on :meth:`size`, in bytes (>= 1).
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_bytes = max_bytes
        self._root = _Node(b"", None)
        self._tick = 0
        self._seq = 0
        self._size: dict[int, int] = {}
        self._heap: dict[int, list[tuple[int, int, _Node]]] = {}
        self._leaves: dict[int, set[_Node]] = {}

    # -- queries -------------------------------------------------------------------

    def size(self, tenant: int) -> int:
        """Bytes of prefix ``tenant`` holds (0 for an unknown tenant)."""
        return self._size.get(tenant, 0)

    def tenants(self) -> list[int]:
        """Tenants holding at least one byte, or inserted with an empty prefix."""
        return list(self._size)

    def match(self, data: bytes) -> dict[int, int]:
        """Length of the longest prefix of ``data`` each tenant holds.

        Returns
        -------
        dict of int to int
            ``tenant -> matched bytes`` for every tenant with a match of at least one
            byte. Read-only: recency is updated by :meth:`insert` of the routed engine.
        """
        out: dict[int, int] = {}
        node = self._root
        pos = 0
        n = len(data)
        while pos < n:
            child = node.children.get(data[pos])
            if child is None:
                break
            text = child.text
            full = data.startswith(text, pos)
            pos += len(text) if full else common_prefix_len(text, data, pos)
            for tenant in child.access:
                out[tenant] = pos
            if not full:
                break  # the data ends or diverges inside this edge
            node = child
        return out

    def node_count(self) -> int:
        """Number of nodes, root excluded (for tests and memory estimates)."""
        return sum(1 for _ in self._nodes()) - 1

    # -- updates -------------------------------------------------------------------

    def insert(self, data: bytes, tenant: int) -> None:
        """Record that ``data`` was routed to ``tenant``, then evict it down to the bound."""
        self._tick += 1
        tick = self._tick
        self._size.setdefault(tenant, 0)
        node = self._root
        pos = 0
        n = len(data)
        while pos < n:
            child = node.children.get(data[pos])
            if child is None:
                leaf = _Node(data[pos:], node)
                node.children[data[pos]] = leaf
                self._hold(leaf, tenant, tick)
                node = leaf
                break
            if data.startswith(child.text, pos):
                pos += len(child.text)
            else:
                common = common_prefix_len(child.text, data, pos)
                child = self._split(child, common)
                pos += common
            access = child.access
            if tenant in access:
                access[tenant] = tick  # fast path: already held, refresh
            else:
                self._hold(child, tenant, tick)
            node = child
        if node is not self._root and node.held_children[tenant] == 0:
            self._push(tenant, node)
        if self._size[tenant] > self.max_bytes:
            self._evict(tenant)

    def remove_tenant(self, tenant: int) -> None:
        """Forget everything ``tenant`` holds (an engine left the table). O(tree)."""
        self._size.pop(tenant, None)
        self._heap.pop(tenant, None)
        self._leaves.pop(tenant, None)
        for node in list(self._nodes()):
            if node is self._root or tenant not in node.access:
                continue
            del node.access[tenant]
            del node.held_children[tenant]
        self._prune(self._root)

    def clear(self) -> None:
        """Forget everything."""
        self._root = _Node(b"", None)
        self._size.clear()
        self._heap.clear()
        self._leaves.clear()

    # -- internals -----------------------------------------------------------------

    def _nodes(self) -> Iterator[_Node]:
        stack = [self._root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _prune(self, node: _Node) -> None:
        for key, child in list(node.children.items()):
            if not child.access:
                del node.children[key]
                child.parent = None
            else:
                self._prune(child)

    def _split(self, child: _Node, common: int) -> _Node:
        """Split ``child``'s label after ``common`` bytes; return the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = _Node(child.text[:common], parent)
        parent.children[child.text[0]] = upper
        child.text = child.text[common:]
        child.parent = upper
        upper.children[child.text[0]] = child
        # Same holders and recency; sizes are unchanged (one label became two).
        upper.access = dict(child.access)
        upper.held_children = dict.fromkeys(child.access, 1)
        return upper

    def _hold(self, node: _Node, tenant: int, tick: int) -> None:
        """Mark ``node`` used by ``tenant`` at ``tick`` (its parent is already held)."""
        if tenant in node.access:
            node.access[tenant] = tick
            return
        node.access[tenant] = tick
        node.held_children[tenant] = 0
        self._size[tenant] += len(node.text)
        leaves = self._leaves.setdefault(tenant, set())
        leaves.add(node)
        parent = node.parent
        if parent is not None and parent is not self._root:
            if parent.held_children[tenant] == 0:
                leaves.discard(parent)
            parent.held_children[tenant] += 1

    def _push(self, tenant: int, node: _Node) -> None:
        heap = self._heap.setdefault(tenant, [])
        self._seq += 1
        heapq.heappush(heap, (node.access[tenant], self._seq, node))
        leaves = self._leaves[tenant]
        if len(heap) > 2 * len(leaves) + 64:
            # Mostly stale entries: rebuild from the live leaves.
            fresh = []
            for leaf in leaves:
                self._seq += 1
                fresh.append((leaf.access[tenant], self._seq, leaf))
            heapq.heapify(fresh)
            self._heap[tenant] = fresh

    def _evict(self, tenant: int) -> None:
        heap = self._heap.get(tenant, [])
        leaves = self._leaves[tenant]
        while self._size[tenant] > self.max_bytes and heap:
            tick, _, node = heapq.heappop(heap)
            if node.access.get(tenant) != tick or node.held_children.get(tenant) != 0:
                # Stale: used again since (which also covers "extended below": the
                # extending insert refreshed the tick). The leaf test is a safety net.
                continue
            del node.access[tenant]
            del node.held_children[tenant]
            leaves.discard(node)
            self._size[tenant] -= len(node.text)
            parent = node.parent
            assert parent is not None
            if not node.access:
                del parent.children[node.text[0]]
                node.parent = None
            if parent is not self._root:
                parent.held_children[tenant] -= 1
                if parent.held_children[tenant] == 0:
                    leaves.add(parent)
                    self._push(tenant, parent)
                    heap = self._heap[tenant]  # _push may have rebuilt it

    def _check(self) -> None:
        """Verify the invariants (tests only; O(tree))."""
        sizes: dict[int, int] = {}
        leaves: dict[int, set[_Node]] = {}
        for node in self._nodes():
            if node is self._root:
                continue
            assert node.text, "empty label"
            assert node.access, "node held by nobody"
            parent = node.parent
            assert parent is not None and parent.children[node.text[0]] is node
            for t in node.access:
                sizes[t] = sizes.get(t, 0) + len(node.text)
                if parent is not self._root:
                    assert t in parent.access, "tenant holds a node but not its parent"
                held = sum(1 for c in node.children.values() if t in c.access)
                assert node.held_children[t] == held, "held_children out of date"
                if held == 0:
                    leaves.setdefault(t, set()).add(node)
        for t, size in self._size.items():
            assert sizes.get(t, 0) == size, f"size of {t} is {size}, counted {sizes.get(t, 0)}"
            assert self._leaves.get(t, set()) == leaves.get(t, set()), "leaf set out of date"
