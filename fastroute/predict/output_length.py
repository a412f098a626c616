"""Output-length predictor: decayed log-bucket histograms with hierarchical back-off.

Model (docs/algorithms.md §6.3, "Output length")
    For every key of the hierarchy ``(tenant, class) → (class,) → ()`` (global) a
    histogram of observed output lengths over **log buckets** (``buckets_per_octave``
    per doubling: bucket ``b`` holds ``[2^(b/q), 2^((b+1)/q))`` tokens), with
    **exponentially decayed** counts and token sums (half-life ``half_life_s``), so the
    estimate follows a changing workload. A query uses the finest key whose effective
    (decayed) count is at least ``min_samples``, else backs off to the next coarser
    one; the global histogram is used whatever its count, and with no data at all the
    ``prior_tokens`` guess is returned.

Queries
    * :meth:`mean` — ``E[N]`` (exact within buckets: the decayed token sums are kept);
    * :meth:`quantile` — interpolated geometrically inside the bucket;
    * :meth:`remaining` — ``E[N − g | N > g]`` for a running request that has produced
      ``g`` tokens (the bucket holding ``g`` is taken as uniform). Beyond every
      observation the answer falls back to one bucket width (``g·(2^(1/q) − 1)``):
      the request is in the tail, and the tail of a log-scale distribution grows
      with ``g``.

Time
    The clock is injected (``now_s`` on :meth:`observe`, optional on queries), as
    everywhere in fastroute; decay is applied lazily per histogram (one O(buckets)
    multiply when it is touched). Queries without ``now_s`` use the state as of the
    last observation, which is what the routing hot path wants (no clock there).

Memory and cost
    At most ``max_keys`` (tenant, class) histograms, least recently *observed* evicted;
    each is two float arrays of ``log2(max_tokens)·q + 1`` buckets (61 by default).
    :meth:`mean` is cached per histogram and costs two dict lookups on the hot path.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import numpy as np

__all__ = ["OutputLengthPredictor"]

Key = tuple[Hashable, ...]


class _Histogram:
    __slots__ = ("counts", "sums", "total", "t_s", "_mean")

    def __init__(self, n_buckets: int) -> None:
        self.counts = np.zeros(n_buckets)
        self.sums = np.zeros(n_buckets)
        self.total = 0.0
        self.t_s = -math.inf
        self._mean: float | None = None

    def decay_to(self, now_s: float, half_life_s: float) -> None:
        if now_s > self.t_s:
            if self.total > 0.0 and math.isfinite(self.t_s):
                f = 0.5 ** ((now_s - self.t_s) / half_life_s)
                self.counts *= f
                self.sums *= f
                self.total *= f
            self.t_s = now_s

    def mean(self) -> float:
        if self._mean is None:
            self._mean = float(self.sums.sum() / self.total)
        return self._mean


class OutputLengthPredictor:
    """Per (tenant, class) output-length histograms with back-off to class and global.

    Parameters
    ----------
    half_life_s : float
        Half-life of the decayed counts, seconds (default one hour).
    min_samples : float
        Effective count a key needs before it is used instead of its parent (50).
    max_tokens : int
        Longest output represented; longer ones go to the last bucket.
    buckets_per_octave : int
        Log-bucket resolution ``q`` (4: buckets 19 % wide).
    prior_tokens : float
        Answer of :meth:`mean` before any observation.
    max_keys : int
        (tenant, class) histograms kept.
    """

    def __init__(
        self,
        *,
        half_life_s: float = 3600.0,
        min_samples: float = 50.0,
        max_tokens: int = 32768,
        buckets_per_octave: int = 4,
        prior_tokens: float = 200.0,
        max_keys: int = 4096,
    ) -> None:
        if half_life_s <= 0 or min_samples < 0 or max_tokens < 2 or buckets_per_octave < 1:
            raise ValueError(
                "half_life_s must be > 0, min_samples >= 0, max_tokens >= 2, "
                "buckets_per_octave >= 1"
            )
        if prior_tokens < 1 or max_keys < 1:
            raise ValueError("prior_tokens and max_keys must be >= 1")
        self.half_life_s = float(half_life_s)
        self.min_samples = float(min_samples)
        self.max_tokens = int(max_tokens)
        self.q = int(buckets_per_octave)
        self.prior_tokens = float(prior_tokens)
        self.max_keys = int(max_keys)
        self.n_buckets = int(math.log2(self.max_tokens) * self.q) + 1
        b = np.arange(self.n_buckets + 1, dtype=np.float64)
        self.edges = 2.0 ** (b / self.q)  # bucket i = [edges[i], edges[i+1])
        self._hists: dict[Key, _Histogram] = {}
        self._n_leaf = 0  # (tenant, class) keys held, bounded by max_keys

    # -- keys ------------------------------------------------------------------------------

    @staticmethod
    def _chain(tenant: Hashable | None, cls: Hashable | None) -> tuple[Key, ...]:
        if cls is None:
            return ((),)
        if tenant is None:
            return ((cls,), ())
        return ((tenant, cls), (cls,), ())

    def bucket(self, tokens: int) -> int:
        """Bucket index of an output length (≥ 1)."""
        return min(self.n_buckets - 1, int(math.log2(max(1, tokens)) * self.q + 1e-9))

    # -- updates ---------------------------------------------------------------------------

    def observe(
        self,
        tokens: int,
        now_s: float,
        *,
        tenant: Hashable | None = None,
        cls: Hashable | None = None,
    ) -> None:
        """Record a finished request's output length at time ``now_s``.

        Raises
        ------
        ValueError
            ``tokens < 1`` or ``now_s`` not finite.
        """
        if tokens < 1:
            raise ValueError(f"an output has at least one token, got {tokens}")
        if not math.isfinite(now_s):
            raise ValueError(f"now_s must be finite, got {now_s}")
        b = self.bucket(tokens)
        for key in self._chain(tenant, cls):
            hist = self._hists.get(key)
            if hist is None:
                if len(key) == 2:
                    if self._n_leaf >= self.max_keys:
                        self._evict_leaf()
                    self._n_leaf += 1
                hist = self._hists[key] = _Histogram(self.n_buckets)
            elif len(key) == 2:
                # Most recently observed last: dict order is the eviction order.
                del self._hists[key]
                self._hists[key] = hist
            hist.decay_to(now_s, self.half_life_s)
            hist.counts[b] += 1.0
            hist.sums[b] += tokens
            hist.total += 1.0
            hist._mean = None

    def _evict_leaf(self) -> None:
        for key in self._hists:
            if len(key) == 2:
                del self._hists[key]
                self._n_leaf -= 1
                return

    def reset(self) -> None:
        """Forget every observation."""
        self._hists.clear()
        self._n_leaf = 0

    # -- queries ---------------------------------------------------------------------------

    def histogram_key(
        self,
        tenant: Hashable | None = None,
        cls: Hashable | None = None,
        now_s: float | None = None,
    ) -> Key | None:
        """The key a query backs off to (``None`` if nothing was observed at all)."""
        last: Key | None = None
        for key in self._chain(tenant, cls):
            hist = self._hists.get(key)
            if hist is None:
                continue
            if now_s is not None:
                hist.decay_to(now_s, self.half_life_s)
            last = key
            if hist.total >= self.min_samples or key == ():
                return key
        return last

    def count(self, tenant: Hashable | None = None, cls: Hashable | None = None) -> float:
        """Effective (decayed) count of the exact key (0 if absent)."""
        hist = self._hists.get(self._chain(tenant, cls)[0])
        return 0.0 if hist is None else hist.total

    def mean(
        self,
        tenant: Hashable | None = None,
        cls: Hashable | None = None,
        now_s: float | None = None,
    ) -> float:
        """``E[N]`` in tokens, after back-off."""
        key = self.histogram_key(tenant, cls, now_s)
        if key is None:
            return self.prior_tokens
        hist = self._hists[key]
        return hist.mean() if hist.total > 0 else self.prior_tokens

    def quantile(
        self,
        q: float,
        tenant: Hashable | None = None,
        cls: Hashable | None = None,
        now_s: float | None = None,
    ) -> float:
        """The ``q``-quantile of N in tokens, after back-off."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"q must be in [0, 1], got {q}")
        key = self.histogram_key(tenant, cls, now_s)
        if key is None or self._hists[key].total <= 0:
            return self.prior_tokens
        hist = self._hists[key]
        cum = np.cumsum(hist.counts)
        target = q * cum[-1]
        i = int(np.searchsorted(cum, target, side="left"))
        i = min(i, self.n_buckets - 1)
        below = cum[i - 1] if i else 0.0
        inside = hist.counts[i]
        frac = 0.0 if inside <= 0 else (target - below) / inside
        lo, hi = self.edges[i], self.edges[i + 1]
        return float(lo * (hi / lo) ** frac)

    def remaining(
        self,
        generated: int,
        tenant: Hashable | None = None,
        cls: Hashable | None = None,
        now_s: float | None = None,
    ) -> float:
        """``E[N − g | N > g]``: expected tokens still to come after ``g`` were produced."""
        g = max(0, int(generated))
        key = self.histogram_key(tenant, cls, now_s)
        if key is None or self._hists[key].total <= 0:
            return max(1.0, self.prior_tokens - g)
        if g == 0:
            return self._hists[key].mean()
        hist = self._hists[key]
        b = self.bucket(g)
        counts, sums = hist.counts, hist.sums
        above_n = float(counts[b + 1 :].sum())
        above_sum = float(sums[b + 1 :].sum())
        lo, hi = float(self.edges[b]), float(self.edges[b + 1])
        if hi > g and counts[b] > 0:
            share = (hi - g) / (hi - lo)  # uniform inside the bucket
            above_n += counts[b] * share
            above_sum += counts[b] * share * (g + hi) / 2.0
        if above_n <= 1e-12:
            return max(1.0, g * (2.0 ** (1.0 / self.q) - 1.0))
        return max(1.0, above_sum / above_n - g)
