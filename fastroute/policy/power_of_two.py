"""``power-of-two``: two random eligible engines, the one with fewer requests in flight.

Algorithm
    The power of two choices (Mitzenmacher, "The Power of Two Choices in Randomized
    Load Balancing", IEEE TPDS 2001; Azar, Broder, Karlin & Upfal, STOC 1994): sample
    two distinct engines uniformly from the class row's eligible engines and send the
    request to the one with fewer requests in flight (host-wide counts from the stats
    block). For ``n`` bins and ``n`` balls the maximum load drops from
    ``Theta(log n / log log n)`` (one random choice) to ``log log n / log 2 + O(1)``,
    and unlike full least-request, independent routers that see stale counts do not
    all herd onto the same idle engine. The failover ranking is the winner, the loser,
    then the rendezvous order of the key. As in SGLang's
    ``sgl-router/src/policies/power_of_two.rs``; Envoy's ``LEAST_REQUEST`` with
    ``choice_count = 2``.

Invariants
    ``in_flight[ranked[0]] <= in_flight[ranked[1]]`` (as read) whenever two or more
    engines are eligible; a tie goes to the first sample. With one eligible engine it
    is chosen. Sampling ignores weights (beyond eligibility).

Tunables
    ``seed`` : int or None; default ``None``. Seed of the policy's own
        ``random.Random``; ``None`` seeds from the OS (production: independent
        workers must not draw identical samples). Pass an integer, or
    ``rng`` : ``random.Random`` or None; an injected generator (the simulator shares
        its seeded one), for reproducible runs.

Cost per request
    One O(n_engines) scan of the eligible mask, two random draws, one rendezvous rank
    for the failover tail.

``Decision.reason`` is ``"p2c"``; ``scores`` are the in-flight counts of ``ranked``
as read.
"""

from __future__ import annotations

import random
from typing import ClassVar

import numpy as np

from fastroute.policy.base import (
    DEFAULT_K,
    Decision,
    FleetView,
    Policy,
    RouteRequest,
    check_k,
    rendezvous_tail,
)

__all__ = ["PowerOfTwo"]


class PowerOfTwo(Policy):
    """Power of two random choices on in-flight requests.

    Parameters
    ----------
    seed : int or None
        Seed of a private ``random.Random``; ``None`` seeds from the OS.
    rng : random.Random or None
        Use this generator instead (takes precedence over ``seed``).
    """

    name: ClassVar[str] = "power-of-two"

    def __init__(self, *, seed: int | None = None, rng: random.Random | None = None) -> None:
        self._seed = seed
        self.rng = rng if rng is not None else random.Random(seed)

    def choose(self, request: RouteRequest, view: FleetView, k: int = DEFAULT_K) -> Decision:
        check_k(k)
        mask = view.eligible(request.row)
        eligible = np.flatnonzero(mask)
        m = len(eligible)
        if m == 0:
            return self._empty()
        loads = view.in_flight()
        if m == 1:
            only = int(eligible[0])
            return self._decision(view, [only], "p2c", [loads[only]])
        a, b = self.rng.sample(range(m), 2)
        first, second = int(eligible[a]), int(eligible[b])
        load_a, load_b = int(loads[first]), int(loads[second])  # read each count once
        if load_b < load_a:
            first, second = second, first
            load_a, load_b = load_b, load_a
        ranked = rendezvous_tail(view, request, mask, [first, second], k)
        scores = [load_a, load_b][:k] + [int(loads[i]) for i in ranked[2:]]
        return self._decision(view, ranked, "p2c", scores)

    def reset(self) -> None:
        if self._seed is not None:
            self.rng.seed(self._seed)
