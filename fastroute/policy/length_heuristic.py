"""``length-heuristic``: long prompts to the least token-loaded engine, short ones by count.

Algorithm
    The "length heuristic" baseline of "Calibrate, Then Route" (arXiv 2609.16206; its
    exact rule is not published, this is ours). A request whose prompt has at least
    ``long_prompt_tokens`` tokens is **long**: it goes to the eligible engine with the
    fewest **token-weighted** load, because a long prefill queued behind other long
    prefills is what blows up TTFT. A **short** request goes to the engine with the
    fewest requests in flight (``least-request``), because for it queue position
    matters more than queued work. Token load, in order of preference:

    1. ``queued_prefill_tokens + running_context_tokens`` of the view's
       :class:`~fastroute.policy.marginal.EngineState` (a view implementing
       ``engine_state()``: the simulator, or the proxy's marginal-cost bookkeeping);
       on a prefill engine this is the queued prefill work, on a decode engine the
       KV context the decode steps read;
    2. else the view's ``in_flight_tokens()`` (prompt + expected output in flight);
    3. else in-flight requests (the rule degrades to ``least-request``).

    Ties are broken by the weighted rendezvous order of the key (:func:`pick_min`). The
    failover ranking repeats the rule on the engines not yet ranked.

Invariants
    ``ranked[0]`` minimises the rule's load over the row's eligible engines as read at
    decision time, and the load is non-decreasing along ``ranked``.

Tunables
    ``long_prompt_tokens`` : int >= 1; default 1024 (about the median prompt of the Azure
    conversation trace: the longer half is "long").

Cost per request
    ``k`` vectorised O(n_engines) passes plus one rendezvous pick each.

``Decision.reason`` is ``"long-prompt"`` or ``"short-prompt"``; ``scores`` are the
loads of ``ranked`` as read.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from fastroute.policy.base import (
    DEFAULT_K,
    Decision,
    FleetView,
    Policy,
    PolicyConfigError,
    RouteRequest,
    check_k,
    rank_by_load,
)

__all__ = ["LengthHeuristic"]


class LengthHeuristic(Policy):
    """Long prompts to the least token-loaded engine, short ones to the least-request one.

    Parameters
    ----------
    long_prompt_tokens : int
        Prompts of at least this many tokens are long; 1024.
    """

    name: ClassVar[str] = "length-heuristic"

    def __init__(self, *, long_prompt_tokens: int = 1024) -> None:
        if not isinstance(long_prompt_tokens, int) or long_prompt_tokens < 1:
            raise PolicyConfigError(
                f"length-heuristic: long_prompt_tokens must be an int >= 1, "
                f"got {long_prompt_tokens!r}"
            )
        self.long_prompt_tokens = long_prompt_tokens

    def choose(self, request: RouteRequest, view: FleetView, k: int = DEFAULT_K) -> Decision:
        check_k(k)
        eligible = view.eligible(request.row)
        long = request.prompt_tokens >= self.long_prompt_tokens
        loads = self._token_loads(view) if long else None
        if loads is None:
            loads = np.array(view.in_flight(), dtype=np.float64)
        ranked = rank_by_load(view, request, eligible, loads, k)
        if not ranked:
            return self._empty()
        reason = "long-prompt" if long else "short-prompt"
        return self._decision(view, ranked, reason, [float(loads[i]) for i in ranked])

    @staticmethod
    def _token_loads(view: FleetView) -> np.ndarray | None:
        getter = getattr(view, "engine_state", None)
        if getter is not None:
            state = getter()
            return state.column("queued_prefill_tokens") + state.column("running_context_tokens")
        tokens = view.in_flight_tokens()
        if tokens is None:
            return None
        return np.array(tokens, dtype=np.float64)

    def __repr__(self) -> str:
        return f"<LengthHeuristic long_prompt_tokens={self.long_prompt_tokens}>"
