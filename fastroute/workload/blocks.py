"""Text of shared prompt blocks: equal block ids give byte-identical text, unequal ids differ.

Engines' prefix caches (emulator and simulator) reuse KV only for byte-identical prompt
text, so a workload that shares *blocks* between requests (Mooncake ``hash_ids``, a
synthetic prefix tree, a RAG document) renders each block from its id alone: every
request naming block ``h`` carries the same ``block_tokens · 4`` bytes for it, and two
different ids differ from their first tag byte on (the tag holds the id).
"""

from __future__ import annotations

from collections.abc import Iterable

from fastroute.workload.session import make_text

__all__ = ["BLOCK_TOKENS", "BlockTexts"]

#: Tokens per block of the Mooncake trace release's ``hash_ids`` (512-token blocks).
BLOCK_TOKENS = 512


class BlockTexts:
    """Block id → text, memoised (a trace names the same hot blocks thousands of times).

    Parameters
    ----------
    namespace : str
        Prefix of every tag: two workloads with different namespaces never share text.
    block_tokens : int
        Tokens per block, ≥ 1 (each block is ``block_tokens · 4`` bytes).
    """

    __slots__ = ("namespace", "block_tokens", "_cache")

    def __init__(self, namespace: str = "block", block_tokens: int = BLOCK_TOKENS) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.namespace = namespace
        self.block_tokens = block_tokens
        self._cache: dict[object, str] = {}

    def text(self, block_id: object) -> str:
        """The text of one block (``block_tokens · 4`` bytes, starting with its id)."""
        text = self._cache.get(block_id)
        if text is None:
            text = self._cache[block_id] = make_text(
                f"{self.namespace} {block_id}", self.block_tokens
            )
        return text

    def join(self, block_ids: Iterable[object]) -> str:
        """The concatenated text of ``block_ids``, in order."""
        return "".join(self.text(b) for b in block_ids)
