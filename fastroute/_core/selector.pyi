from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

class Selector:
    """Weighted rendezvous-hashing engine selector over a weight table (compiled)."""

    n_engines: int
    n_classes: int
    def __init__(
        self, engine_ids: Sequence[int] | npt.ArrayLike, weights: npt.ArrayLike
    ) -> None: ...
    @property
    def engine_ids(self) -> np.ndarray:
        """The engine ids, in table order (read-only)."""
    def pick(self, key_hash: int, row: int, available: Any = None) -> int:
        """Return the engine index for ``key_hash`` in class ``row``, or -1 if none."""
    def rank(self, key_hash: int, row: int, k: int, available: Any = None) -> list[int]:
        """Return up to ``k`` engine indices in rendezvous (failover) order."""
    def pick_bounded(
        self,
        key_hash: int,
        row: int,
        loads: npt.ArrayLike,
        balance_factor: float = 2.0,
        available: Any = None,
    ) -> int:
        """Pick with a bounded-load guard (walks the ranking past overloaded engines)."""
    def rank_prefix(
        self,
        key_hashes: Sequence[int],
        row: int,
        k: int,
        loads: npt.ArrayLike,
        balance_factor: float,
        available: Any = None,
    ) -> tuple[list[int], int]:
        """Rank by the first key whose home is within its bounded share."""
    def least_loaded(
        self, key_hash: int, row: int, loads: npt.ArrayLike, available: Any = None
    ) -> int:
        """The eligible engine of ``row`` with the smallest load; ties by rendezvous order."""
    def tree_size(self, row: int, available: Any = None) -> int:
        """How many engines of ``row`` are eligible (weight > 0, not masked out)."""
    def tree_rank(self, key_hash: int, row: int, k: int, available: Any = None) -> list[int]:
        """Up to ``k`` engine indices in hierarchical rendezvous order (``selector_tree``)."""
    def tree_rank_prefix(
        self,
        key_hashes: Sequence[int],
        row: int,
        k: int,
        loads: npt.ArrayLike,
        balance_factor: float,
        available: Any = None,
        home_slack: int = 0,
    ) -> tuple[list[int], int]:
        """``rank_prefix`` on the tree ranking, with bounded-staleness load totals; the
        first key's home is within bound with ``home_slack`` (load units)."""
    def tree_least_loaded(
        self, key_hash: int, row: int, loads: npt.ArrayLike, available: Any = None
    ) -> int:
        """The cost spill's least-loaded engine from the tree's load chunks."""
