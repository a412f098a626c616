"""Decayed shares of the recent work per key: which prefix groups are hot.

A key's **share** is the token weight of the recent requests that carried it over the
token weight of all recent requests, each request's weight decaying by half every
``half_life_requests`` requests (a logical clock: one tick per observed request, so
the estimate reads no clock and replays identically). Decay is applied lazily, per key
when it is touched, so an observation costs one dictionary update per key.

Memory is bounded: beyond ``max_keys`` entries the keys whose share fell below
``1 / max_keys`` are dropped (they cannot be hot), and if that frees less than half,
the least recently seen half is dropped.

Each proxy worker keeps its own estimate from the requests it sees. Workers see
random samples of the same traffic (the kernel spreads connections), so a key that is
hot for the host is hot for each worker: unlike a per-worker record of *where* things
were sent, a share estimate does not fragment.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["HotKeys"]


class HotKeys:
    """Exponentially decayed per-key shares of the observed token weight.

    Parameters
    ----------
    half_life_requests : float
        Requests after which an observation counts half; > 0.
    max_keys : int
        Entries kept before pruning; >= 16.
    """

    __slots__ = ("_decay", "_half_life", "_max_keys", "_t", "_total", "_counts")

    def __init__(self, half_life_requests: float, max_keys: int = 65536) -> None:
        if not half_life_requests > 0:
            raise ValueError(f"half_life_requests must be > 0, got {half_life_requests}")
        if max_keys < 16:
            raise ValueError(f"max_keys must be >= 16, got {max_keys}")
        self._half_life = float(half_life_requests)
        self._decay = 0.5 ** (1.0 / self._half_life)
        self._max_keys = max_keys
        self._t = 0
        self._total = 0.0
        # key -> [weight as of stamp, stamp, 1.0 if hot at its last is_hot() else 0.0]
        self._counts: dict[int, list[float]] = {}

    @property
    def requests(self) -> int:
        """Requests observed so far (the logical clock)."""
        return self._t

    def __len__(self) -> int:
        return len(self._counts)

    def observe(self, keys: Iterable[int], weight: float) -> None:
        """One request of token weight ``weight`` (> 0) carried ``keys`` (distinct)."""
        t = self._t = self._t + 1
        decay = self._decay
        self._total = self._total * decay + weight
        counts = self._counts
        for key in keys:
            entry = counts.get(key)
            if entry is None:
                counts[key] = [weight, t, 0.0]
            else:
                entry[0] = entry[0] * decay ** (t - entry[1]) + weight
                entry[1] = t
        if len(counts) > self._max_keys:
            self._prune()

    def share(self, key: int) -> float:
        """The key's decayed share of the observed weight, in [0, 1]; 0 if unseen."""
        entry = self._counts.get(key)
        if entry is None or self._total <= 0.0:
            return 0.0
        return entry[0] * self._decay ** (self._t - entry[1]) / self._total

    def is_hot(self, key: int, enter_share: float, leave_share: float) -> bool:
        """Whether ``key``'s group is hot, with hysteresis: it becomes hot above
        ``enter_share`` and stays hot until its share falls below ``leave_share``, so a
        group near the threshold does not flip between engines request by request."""
        entry = self._counts.get(key)
        if entry is None or self._total <= 0.0:
            return False
        share = entry[0] * self._decay ** (self._t - entry[1]) / self._total
        hot = share > enter_share or (share >= leave_share and entry[2] > 0.0)
        entry[2] = 1.0 if hot else 0.0
        return hot

    def reset(self) -> None:
        """Forget every observation."""
        self._t = 0
        self._total = 0.0
        self._counts.clear()

    def _prune(self) -> None:
        floor = self._total / self._max_keys
        t, decay = self._t, self._decay
        counts = self._counts
        cold = [k for k, (w, s, _) in counts.items() if w * decay ** (t - s) < floor]
        for key in cold:
            del counts[key]
        if len(counts) > self._max_keys // 2:
            by_age = sorted(counts, key=lambda k: counts[k][1])
            for key in by_age[: len(counts) - self._max_keys // 2]:
                del counts[key]
