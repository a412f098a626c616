"""Paged KV cache with a prefix cache of chained block hashes and LRU eviction.

The cache counts blocks; it does not place them. A block is in exactly one of
three states:

* **free**: holds nothing;
* **cached**: holds the KV of a full prompt block, named by its chained hash
  (:mod:`fastroute.tokens`); it has a reference count, and when the
  count drops to 0 it stays cached but becomes *evictable*, kept in LRU order;
* **private**: referenced by exactly one request and not (yet) named — a
  partially filled block or one with generated tokens.

Allocation takes free blocks first, then evicts the least recently released
cached block (vLLM's free-block queue does the same). Usage, as vLLM reports it
in ``vllm:kv_cache_usage_perc``, is the share of blocks referenced by requests:
evictable cached blocks count as free.

Every operation is O(number of blocks touched); nothing scans the cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["KVCache"]


class KVCache:
    """Block accounting and prefix cache of one engine.

    Parameters
    ----------
    num_blocks : int
        Capacity in blocks.
    """

    __slots__ = ("num_blocks", "_num_free", "_refs", "_lru")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._num_free = num_blocks
        self._refs: dict[int, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()

    # -- introspection -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks holding nothing."""
        return self._num_free

    @property
    def num_evictable(self) -> int:
        """Cached blocks no request references (reclaimable, LRU order)."""
        return len(self._lru)

    @property
    def num_available(self) -> int:
        """Blocks an allocation may take: free plus evictable."""
        return self._num_free + len(self._lru)

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one request."""
        return self.num_blocks - self._num_free - len(self._lru)

    @property
    def num_cached(self) -> int:
        """Blocks named by a hash (referenced or evictable)."""
        return len(self._refs)

    @property
    def usage(self) -> float:
        """Share of blocks in use, 0–1 (vLLM's KV-cache usage)."""
        return self.num_used / self.num_blocks

    # -- prefix cache --------------------------------------------------------------------------
    def lookup(self, block_hashes: Sequence[int], max_blocks: int) -> tuple[int, int]:
        """Count the leading cached blocks of a prompt.

        Parameters
        ----------
        block_hashes : sequence of int
            The prompt's chained block hashes.
        max_blocks : int
            At most this many blocks may hit.

        Returns
        -------
        (hits, hits_evictable) : tuple of int
            Number of leading blocks cached, and how many of those are evictable
            (acquiring them shrinks :attr:`num_available`).
        """
        refs = self._refs
        hits = evictable = 0
        for h in block_hashes[:max_blocks]:
            count = refs.get(h)
            if count is None:
                break
            hits += 1
            if count == 0:
                evictable += 1
        return hits, evictable

    def acquire(self, block_hashes: Sequence[int]) -> None:
        """Reference cached blocks (all must be cached, e.g. from :meth:`lookup`)."""
        refs, lru = self._refs, self._lru
        for h in block_hashes:
            count = refs[h]
            if count == 0:
                del lru[h]
            refs[h] = count + 1

    def release(self, block_hashes: Sequence[int]) -> None:
        """Drop one reference to each cached block; unreferenced ones become evictable (MRU)."""
        refs, lru = self._refs, self._lru
        for h in block_hashes:
            count = refs[h] - 1
            refs[h] = count
            if count == 0:
                lru[h] = None

    def name_block(self, block_hash: int) -> None:
        """Turn one private block into the cached block ``block_hash``.

        The caller gives up one private block and holds a reference to
        ``block_hash`` instead. If that hash is already cached (another request
        computed the same block), the private block is freed and the existing
        one shared, so identical prefixes never occupy two blocks for long.
        """
        count = self._refs.get(block_hash)
        if count is None:
            self._refs[block_hash] = 1
            return
        if count == 0:
            del self._lru[block_hash]
        self._refs[block_hash] = count + 1
        self._num_free += 1

    # -- private blocks ------------------------------------------------------------------------
    def allocate(self, n: int) -> bool:
        """Take ``n`` private blocks, evicting LRU cached blocks if needed; False if impossible."""
        if n <= self._num_free:
            self._num_free -= n
            return True
        if n > self._num_free + len(self._lru):
            return False
        n -= self._num_free
        self._num_free = 0
        refs, lru = self._refs, self._lru
        for _ in range(n):
            h, _ = lru.popitem(last=False)
            del refs[h]
        return True

    def free(self, n: int) -> None:
        """Return ``n`` private blocks."""
        self._num_free += n
