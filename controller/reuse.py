"""How much prefix reuse raises an engine group's capacity (docs/controller.md, "Capacity with
prefix reuse").

``capacity_rps`` is rated without prefix reuse: ``fastroute bench capacity`` and the simulator
measure it with every prompt token prefilled. A prompt token the engine finds in its prefix cache
costs no prefill, so an engine whose requests hit its cache serves more of them; an LP that plans
with the rating alone sheds requests the fleet would serve (measured: on the bursty RAG family at
90 % the controller shed 146 of 2458 requests in the simulator, 19 of 394 on the emulated fleet,
while 98.7 % of the admitted met their SLOs).

**Cost model.** Per request an engine prefills its uncached prompt tokens and generates its
output; a cached prompt token costs nothing. With a generated token worth ``β`` prefilled ones
(:data:`DECODE_TOKEN_COST`), over a window in which an engine group was queried for ``Q`` prompt
tokens, found ``H`` of them cached and generated ``G`` tokens, a request costs
``(Q − H + β·G) / (Q + β·G)`` of what it would cost without reuse, so::

    gain = (Q + β·G) / (Q − H + β·G)

``β`` depends on what bounds the engine. A step-budget-bound engine (chunked prefill at
saturation, long prompts) spends a slot of its step's token budget on a generated token as on
a prefilled one: ``β ≈ 1``. A sequence-bound engine (short prompts, long outputs, at its
``max_num_seqs``) spends a decode step's weight read on a few dozen tokens: ``β`` is several.
Measured against the emulator's step-time model (saturation capacity with each prompt cut by the
hit fraction over the same without; docs/controller.md has the table): an A40 serving Qwen2.5-3B
on RAG, chat, agentic and 10 k-token prompts is fitted by ``β = 1`` and under-rated by ``β = 4``;
an H100 at 64 sequences on two-turn chat (985 / 285 tokens) is fitted by ``β = 4`` and
over-rated by ``β = 1`` (2.19 where the model has 1.60, at a 70 % hit rate). The controller takes
``β = 4``: it never over-rated in these regimes, and an under-rated gain costs only the shed it
fails to avoid (the bursty RAG family needs a gain of about 2; ``β = 4`` planned with 2.2,
``β = 1`` with 2.7: the same goodput, ``python bench/reuse_gain.py``).

**Bounds.** The counts are the engines' own counters over the prefix-hit window
(:data:`fastroute.signals.prefix_cache.DEFAULT_WINDOW_S`, 60 s), summed over the group's peers
(one gain per group, so an engine's share does not follow its own hit rate back into more
hits). An engine that does not count generated tokens, or has no counters, gives no evidence:
its group's gain is 1 without one. The gain is floored to the grid ``GAIN_STEP ** k`` (a
change moves the LP only when it is at least 10 %, and the estimate is never rounded up) and
capped at ``max_gain`` (``controller.max_reuse_gain``): the window is history, and a workload
that turns uncached within it finds the fleet over-rated by at most that factor until the
window catches up (the proxies' queue-delay guard answers what the LP then admits too much
of).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from fastroute.signals.prefix_cache import PrefixHitRate

__all__ = ["DECODE_TOKEN_COST", "GAIN_STEP", "group_reuse_gains", "hit_counts", "reuse_gain"]

FloatArray = npt.NDArray[np.float64]

#: ``β``: what one generated token costs an engine, in prefilled prompt tokens (see the module
#: doc: 1 for a step-budget-bound engine, about 4 for a sequence-bound one; the larger, so the
#: gain errs low).
DECODE_TOKEN_COST = 4.0

#: Ratio between neighbouring gain levels: a 10 % step is below what the LP's inputs
#: resolve (the demand forecast's dead band is about ±8 % at 150 requests a period).
GAIN_STEP = 1.1


def reuse_gain(
    queried_tokens: float,
    hit_tokens: float,
    generated_tokens: float,
    *,
    max_gain: float,
    decode_token_cost: float = DECODE_TOKEN_COST,
) -> float:
    """Capacity gain of prefix reuse for one window's token counts (see the module doc).

    Parameters
    ----------
    queried_tokens, hit_tokens, generated_tokens : float
        Prompt tokens queried, found cached, and output tokens generated (≥ 0; NaN: unknown).
    max_gain : float
        Cap (≥ 1; 1 turns the gain off).
    decode_token_cost : float
        ``β``, a generated token's cost in prefilled tokens (> 0).

    Returns
    -------
    float
        ``(Q + β·G) / (Q − H + β·G)`` floored to the ``GAIN_STEP`` grid, within
        ``[1, max_gain]``; 1 when a count is unknown or there was no work.
    """
    if not max_gain >= 1.0:
        raise ValueError(f"max_gain must be >= 1, got {max_gain!r}")
    if not decode_token_cost > 0:
        raise ValueError(f"decode_token_cost must be > 0, got {decode_token_cost!r}")
    q, h, g = queried_tokens, hit_tokens, generated_tokens * decode_token_cost
    if not (q >= 0 and g >= 0 and 0 <= h <= q) or q + g <= 0:  # NaN fails every comparison
        return 1.0
    uncached = q - h + g
    if uncached <= 0:  # everything cached: as much as the cap allows
        return float(max_gain)
    raw = (q + g) / uncached
    level = GAIN_STEP ** math.floor(math.log(raw) / math.log(GAIN_STEP) + 1e-9)
    return float(min(max_gain, max(1.0, level)))


def hit_counts(rates: Sequence[PrefixHitRate]) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Per engine, its window's (queried, hit, generated) tokens; NaN where not counted."""
    nan = math.nan
    queried = [nan if r.queries_tokens is None else r.queries_tokens for r in rates]
    hit = [nan if r.hits_tokens is None else r.hits_tokens for r in rates]
    generated = [nan if r.generated_tokens is None else r.generated_tokens for r in rates]
    as_array = np.asarray
    return (
        as_array(queried, dtype=np.float64),
        as_array(hit, dtype=np.float64),
        as_array(generated, dtype=np.float64),
    )


def group_reuse_gains(
    queried_tokens: npt.ArrayLike,
    hit_tokens: npt.ArrayLike,
    generated_tokens: npt.ArrayLike,
    group_of_engine: npt.ArrayLike,
    *,
    max_gain: float,
    decode_token_cost: float = DECODE_TOKEN_COST,
) -> FloatArray:
    """Per engine, the gain of its group's summed token counts.

    Parameters
    ----------
    queried_tokens, hit_tokens, generated_tokens : array_like, shape (n_engines,)
        Each engine's window counts; NaN where an engine does not count them (it then adds
        nothing to its group's sums).
    group_of_engine : array_like of int, shape (n_engines,)
        Peer group per engine (same hardware shape).
    max_gain, decode_token_cost : float
        See :func:`reuse_gain`.

    Returns
    -------
    ndarray, shape (n_engines,)
        Every member of a group has its group's gain (1 for a group with no counted engine).
    """
    q = np.asarray(queried_tokens, dtype=np.float64)
    h = np.asarray(hit_tokens, dtype=np.float64)
    g = np.asarray(generated_tokens, dtype=np.float64)
    group = np.asarray(group_of_engine, dtype=np.intp)
    if not (q.shape == h.shape == g.shape == group.shape) or q.ndim != 1:
        raise ValueError("the token counts and group_of_engine must be 1-D arrays of one length")
    counted = np.isfinite(q) & np.isfinite(h) & np.isfinite(g)
    n_groups = int(group.max(initial=-1)) + 1
    sums = [np.bincount(group[counted], x[counted], n_groups) for x in (q, h, g)]
    gains = np.array(
        [
            reuse_gain(sq, sh, sg, max_gain=max_gain, decode_token_cost=decode_token_cost)
            for sq, sh, sg in zip(*sums, strict=True)
        ],
        dtype=np.float64,
    )
    has_count = np.bincount(group[counted], minlength=n_groups) > 0
    gains[~has_count] = 1.0
    return gains[group] if group.size else np.ones(0)
