"""The ``prefix-hrw`` policy as it was before its per-request work moved into the
compiled core: a frozen pure-Python reference that the replay test routes the same
requests through (``test_prefix_hrw_replay.py``). Do not change it to follow the policy:
a difference in decisions is what the replay test is for.

Re-recorded once, deliberately (2026-12-02, issue 20 "decision cost"): the rankings are
the selector's hierarchical rendezvous (``tree_rank_prefix``, ``tree_least_loaded``;
``fastroute/_core/selector_tree.py``) instead of flat rendezvous, so that a decision
costs O(log n) at 10,000 engines; everything else is as frozen.

Re-recorded a second time, deliberately (2026-12-03, issue 20 "default policy"): the loads
are the view's queued prompt tokens where it tracks them, and the cost spill compares the
home's extra queue with the saving for every request (the ``AFFINITY_CACHED_FRACTION``
gate, which only existed because in-flight tokens overstated the queue, is gone).

Re-recorded a third time, deliberately (2026-12-03, issue 20 "default policy", the cold
start): before 2 n observations a request is ranked by its routing key when that is one
of its keys, else by its deepest key (no longer by its shallowest keys), so that fresh
workers do not all send a prompt that everybody shares to one home, and the cost spill's
saving is then only the depth the share table observed (the deciding key was not chosen for
its cache); what ``on_routed`` observes is unchanged.

Re-recorded a fourth time, deliberately (2026-12-03, issue 20 "default policy", the share's
unit): a group's share counts requests, not prompt tokens, because one long agent session
whose prompts are mostly cached weighed like a popular group on its prompt tokens, went hot
and was split away from its cache.

Re-recorded a fifth time, deliberately (2026-12-04, issue 20 "default policy", the cost
spill's price): a request is cost-spilled only when the home's extra queue exceeds the
saving plus the target's own queue, because the spilled request prefills its prefix again
and that work delays whatever queues behind it at the target (in a burst, when every
engine has a queue, spilling spent the fleet's capacity on re-prefills: with the seen
table below, 4-5 % of goodput in the simulator); and the saving is read from a second
table that observes every depth of every routed request (the share table observes them
only through the deciding key's next depth, so a 3 k-token document's cached prefix read
as 512 tokens).

Re-recorded a sixth time, deliberately (2026-12-04, issue 20 "default policy", sessions
that change engine): the first candidate's home is within the load bound iff its load
less ``affinity_slack`` times the request's saving is (the saving computed before the
ranking, as the cost spill computes it), because on a lightly loaded fleet one queued long
prompt put a cached agent session's home over a bound that ignored what staying saves, and
the session re-prefilled its whole context elsewhere (then came back: 14 % of consecutive
turns changed engine through the fleet, and its p99 TTFT was 2.2x sglang-router's).

Re-recorded a seventh time, deliberately (2026-12-07, issue 20 "default policy", the
re-prefill's stall): the cost spill also pays ``stall_weight`` times the saving per request
in flight at its target, and the first home's load-bound slack grows by the same stall at
the engine the bound would send the request to (ranked again with it), because the
re-prefilled saving stalls every decode there between two of its tokens; past the fleet's
capacity on shared documents the spills' re-prefills pushed the decodes over the TBOT SLO
(`rag` at 4x nominal: 11.3 req/s of goodput against `cache-aware`'s 26.2 in the simulator;
20.3 with the stall priced in both rules).

Re-recorded an eighth time, deliberately (2026-12-07, issue 20 "default policy", the last
placement): the seen table records, per key, the engine the last request carrying it was
routed to, and a request whose deepest seen depth is below its first candidate's (a
conversation's history, a document's deeper blocks) and was last sent elsewhere than the
ranking's first engine goes there instead (reason ``"prefix-follow"``, that depth its
saving) when that engine is eligible and within the load bound less the saving, then the
cost spill decides from there, because a spill placed the prefix away from its rendezvous
home and the requests that extended it re-prefilled it at the home (`rag` at 4x nominal
20.3 -> 25.9 req/s in the simulator, `bursts` 19.8 -> 23.3).

Re-recorded a ninth time, deliberately (2026-12-07, issue 20 "default policy", repeated
prompts): a request with no routing key among its keys (a completion prompt) has its whole
prompt as its deepest key (``xxh3`` of the bytes read, mixed with its token count), and a
request all of whose keys are hot, when its whole prompt is hot too and it is not a
declared session, is ranked by that key salted with a count of such decisions (reason
``"repeat-spread"``), because a group of identical prompts has no deeper key to split it
by and its load (decodes, with nothing left to prefill) is invisible to the token bound:
every request of a prompt sent by everybody went to one engine (the simulator, one
prompt repeated at 0.9 of capacity: max/min engine load 61, TBOT p99 0.052 s against
round robin's 0.017 s; a completion-style hot system prompt left engines idle).

Re-recorded a tenth time, deliberately (2026-12-07, issue 20 "default policy", repeated
prompts): whether a whole prompt is hot is told by a share table of its own, of every
request that is not a declared session, with a half-life of 16 requests per eligible engine
(the most a decision saw), and no longer waits for every other key of the request to be hot:
a session's prompt grows, so its whole key never repeats and needs no memory longer than the
share's noise, while the depth keys' long half-life (1024 requests) held a new prompt sent
by many on one engine for its first ~490 requests (five prompts repeated at 3x nominal
without the shed: 70.9 req/s, round robin 76.1). A hot whole prompt gets ``ceil(share /
(h / n))`` replicas, the first of its key's ranking, taken in turn by a count of such
decisions (each within the bound; past 64, that many salted homes), instead of every engine
by a salt: each replica prefills it once, and fewer of them miss (the simulator at 16
engines: prefix hits -3.3 points with every engine, +0.9 with the replicas).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import ClassVar

import numpy as np
import xxhash

from fastroute._core.selector_py import mix64
from fastroute.policy.base import (
    DEFAULT_K,
    Decision,
    FleetView,
    Policy,
    PolicyConfigError,
    RouteRequest,
    check_k,
)
from fastroute.tokens import BYTES_PER_TOKEN


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
        # key -> [weight as of stamp, stamp, 1.0 if hot at its last is_hot() else 0.0,
        #         engine id of its last observation (0: not known)]
        self._counts: dict[int, list[float]] = {}

    @property
    def requests(self) -> int:
        """Requests observed so far (the logical clock)."""
        return self._t

    def __len__(self) -> int:
        return len(self._counts)

    def observe(self, keys: Iterable[int], weight: float, engine_id: int = 0) -> None:
        """One request of token weight ``weight`` (> 0) carried ``keys`` (distinct) and went
        to ``engine_id``."""
        t = self._t = self._t + 1
        decay = self._decay
        self._total = self._total * decay + weight
        counts = self._counts
        for key in keys:
            entry = counts.get(key)
            if entry is None:
                counts[key] = [weight, t, 0.0, engine_id]
            else:
                entry[0] = entry[0] * decay ** (t - entry[1]) + weight
                entry[1] = t
                entry[3] = engine_id
        if len(counts) > self._max_keys:
            self._prune()

    def share(self, key: int) -> float:
        """The key's decayed share of the observed weight, in [0, 1]; 0 if unseen."""
        entry = self._counts.get(key)
        if entry is None or self._total <= 0.0:
            return 0.0
        return entry[0] * self._decay ** (self._t - entry[1]) / self._total

    def engine(self, key: int) -> int:
        """The engine id of the key's last observation; 0 if unseen or not known."""
        entry = self._counts.get(key)
        return 0 if entry is None else int(entry[3])

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


_ORDERS = ("shallow", "deep")
_ALL = 1 << 30
_hash = xxhash.xxh3_64_intdigest

#: A hot group stays hot until its share falls below this fraction of the entry
#: threshold (hysteresis: a group near the threshold must not flip engines per request).
HOT_LEAVE_RATIO = 0.5

#: Candidate keys tried against the load bound: the first group that is not hot and
#: its first sub-group that is not hot (then the deepest key, whose rendezvous order the
#: bounded fallback uses). More candidates cost one O(n) ranking each and rarely change
#: the pick.
MAX_CANDIDATES = 2

#: Smallest ``block_bytes`` accepted: below it a depth key is mostly chat-template bytes.
MIN_BLOCK_BYTES = 64


def depth_keys(prefix: bytes, block_bytes: int) -> list[tuple[int, int]]:
    """``(depth_bytes, xxh3_64(prefix[:depth_bytes]))`` for doubling depths, shallow first.

    Depths are ``block_bytes · 2^j`` for ``j >= 0`` while at most ``len(prefix)``; empty
    when the prefix is shorter than one block. (Unseeded xxh3 of each whole prefix: a
    seeded xxh3 derives a secret per call, which costs more than the extra bytes.)
    """
    keys = []
    depth = block_bytes
    view = memoryview(prefix)
    while depth <= len(prefix):
        keys.append((depth, _hash(view[:depth])))
        depth *= 2
    return keys


class ReferencePrefixHRW(Policy):
    """Rendezvous homes of the prompt's prefix depths, hot groups spread, load bounded.

    Parameters
    ----------
    block_bytes : int
        Shallowest prefix depth in bytes, ``>= 64``; default 512.
    prefix_bytes : int
        Deepest prefix depth read, bytes, ``>= block_bytes``; default 32768.
    balance_factor : float
        ``c >= 1``: bound on an engine's share of the in-flight tokens over its LP share;
        default 2.0.
    hot_share_factor : float
        ``h > 0``: a group whose share of the recent tokens exceeds ``h / n`` is hot;
        default 0.5.
    hot_half_life_requests : float
        Half-life of the group-share estimate, requests, ``> 0``; default 1024.
    order : {"shallow", "deep"}
        Which depth key is tried first; default ``"shallow"``.
    affinity_slack : float
        ``>= 0``: the first home's load bound is relaxed by this times the saving, tokens
        per saved token; default 1.0.
    stall_weight : float
        ``>= 0``: the cost spill also pays this times the saving per request in flight at
        its target; default 0.1.
    """

    name: ClassVar[str] = "prefix-hrw"
    needs_prefix: ClassVar[bool] = True

    def __init__(
        self,
        *,
        block_bytes: int = 512,
        prefix_bytes: int = 32768,
        balance_factor: float = 2.0,
        hot_share_factor: float = 0.5,
        hot_half_life_requests: float = 1024.0,
        order: str = "shallow",
        affinity_slack: float = 1.0,
        stall_weight: float = 0.1,
    ) -> None:
        if not isinstance(block_bytes, int) or block_bytes < MIN_BLOCK_BYTES:
            raise PolicyConfigError(
                f"prefix-hrw: block_bytes must be an integer >= {MIN_BLOCK_BYTES}, "
                f"got {block_bytes!r}"
            )
        if not isinstance(prefix_bytes, int) or prefix_bytes < block_bytes:
            raise PolicyConfigError(
                f"prefix-hrw: prefix_bytes must be an integer >= block_bytes "
                f"({block_bytes}), got {prefix_bytes!r}"
            )
        if not balance_factor >= 1.0:
            raise PolicyConfigError(
                f"prefix-hrw: balance_factor must be >= 1, got {balance_factor!r}"
            )
        if not hot_share_factor > 0:
            raise PolicyConfigError(
                f"prefix-hrw: hot_share_factor must be > 0, got {hot_share_factor!r}"
            )
        if not hot_half_life_requests > 0:
            raise PolicyConfigError(
                f"prefix-hrw: hot_half_life_requests must be > 0, got {hot_half_life_requests!r}"
            )
        if order not in _ORDERS:
            raise PolicyConfigError(f"prefix-hrw: order must be one of {_ORDERS}, got {order!r}")
        self.block_bytes = block_bytes
        self.prefix_bytes = prefix_bytes
        self.balance_factor = float(balance_factor)
        self.hot_share_factor = float(hot_share_factor)
        self.hot_half_life_requests = float(hot_half_life_requests)
        self.order = order
        self.affinity_slack = float(affinity_slack)
        self.stall_weight = float(stall_weight)
        self.hot = HotKeys(self.hot_half_life_requests)
        self.seen = HotKeys(self.hot_half_life_requests)
        # The keys of the last decided request, for on_routed (same request object).
        self._last: tuple[RouteRequest | None, list[int]] = (None, [])
        self._observe_upto = _ALL
        self._every_hot = False
        self._repeats = 0
        self.wholes = HotKeys(16.0)
        self._wholes_engines = 1
        self._whole_last: int | None = None

    def keys(self, request: RouteRequest) -> list[tuple[int, int]]:
        """The request's ``(depth_bytes, key)`` pairs, shallow first (see the module)."""
        read = request.prefix[: self.prefix_bytes]
        keys = depth_keys(read, self.block_bytes)
        depth = request.key_depth_bytes
        if depth >= 0 and keys:
            at = 0
            while at < len(keys) and keys[at][0] <= depth:
                at += 1
            keys.insert(at, (depth, request.key_hash))
        elif keys:
            keys.append((len(read), self._whole(request)))
        return keys or [(0, request.key_hash)]

    def _whole(self, request: RouteRequest) -> int:
        """The whole prompt's key: the bytes read, and the prompt's tokens."""
        return _hash(request.prefix[: self.prefix_bytes]) ^ mix64(request.prompt_tokens)

    def choose(self, request: RouteRequest, view: FleetView, k: int = DEFAULT_K) -> Decision:
        check_k(k)
        keys = self.keys(request)
        self._last = (request, [h for _, h in keys])
        mask = view.eligible(request.row)
        candidates = self._candidates(keys, mask, (request.key_depth_bytes, request.key_hash))
        repeat, turn = False, -1
        self._whole_last = None
        if request.key_depth_bytes != 0:
            whole = self._whole_last = self._whole(request)
            if self._every_hot:
                if keys[-1][1] != whole:
                    keys.append((len(request.prefix[: self.prefix_bytes]), whole))
                    self._last = (request, [h for _, h in keys])
                self._observe_upto = len(keys)
            n = int(np.count_nonzero(mask))
            if n > 1 and self.hot.requests >= 2 * n:
                if n > self._wholes_engines:
                    self._wholes_engines = n
                    self.wholes._decay = 0.5 ** (1.0 / (16.0 * n))
                enter = self.hot_share_factor / n
                if self.wholes.is_hot(whole, enter, enter * HOT_LEAVE_RATIO):
                    self._repeats += 1
                    read = len(request.prefix[: self.prefix_bytes])
                    replicas = max(1, min(n, math.ceil(self.wholes.share(whole) / enter)))
                    turn = self._repeats % replicas
                    if replicas > 64:
                        candidates, turn = [(read, whole ^ mix64(1 + turn))], -1
                    else:
                        candidates = [(read, whole)]
                    repeat = True
                    self._observe_upto = len(keys)
        loads = view.queued_tokens()
        if loads is None:
            loads = view.in_flight_tokens()
        if loads is None:
            loads = view.in_flight()
        n_eligible = int(np.count_nonzero(mask))
        cold = n_eligible > 1 and self.hot.requests < 2 * n_eligible
        home_saving = self._saving_tokens(keys, 0 if cold else candidates[0][0])
        candidate_keys = [h for _, h in candidates]
        slack = int(self.affinity_slack * home_saving)
        ranked, used = view.selector.tree_rank_prefix(
            candidate_keys, request.row, k, loads, self.balance_factor, mask, slack
        )
        if ranked and used > 0 and self.stall_weight > 0:
            # Leaving the home also stalls the decodes where the bound sends it.
            stall = int(self.stall_weight * home_saving * int(view.in_flight()[ranked[0]]))
            if stall > 0:
                ranked, used = view.selector.tree_rank_prefix(
                    candidate_keys, request.row, k, loads, self.balance_factor, mask, slack + stall
                )
        if not ranked:
            return self._empty()
        if repeat and turn >= 0:  # the replica whose turn it is, if within bound
            target = view.selector.tree_rank(candidate_keys[0], request.row, turn + 1, mask)[-1]
            if target != ranked[0] and view.selector.tree_within_bound(
                target, request.row, loads, self.balance_factor, mask, 0
            ):
                ranked = [target, *(i for i in ranked if i != target)][:k]
        declared = False
        if used >= len(candidates):
            reason, depth, saving = "bounded-spill", -1, 0.0
        else:
            depth = candidates[used][0]
            reason = "prefix-home" if used == 0 else "prefix-spill"
            if repeat:
                reason = "repeat-spread"
            elif len(request.prefix) < self.block_bytes:
                reason = "no-prefix"
            declared = depth == 0 and request.key_depth_bytes == 0  # the client's session
            saving = home_saving if used == 0 else self._saving_tokens(keys, 0 if cold else depth)
        if not declared:
            placed, placed_depth = self._last_placement(
                view, request, keys, candidates[0][0], ranked[0], loads, mask
            )
            if placed >= 0:
                ranked = [placed, *(i for i in ranked if i != placed)][:k]
                reason, depth, saving = (
                    "prefix-follow",
                    placed_depth,
                    placed_depth / BYTES_PER_TOKEN,
                )
            least = -1
            if placed >= 0 or used < len(candidates):
                least = self._cheaper_elsewhere(request, keys, saving, ranked[0], loads, view)
            if least >= 0:
                ranked = [least, *(i for i in ranked if i != least)][:k]
                reason, depth = "cost-spill", -1
        scores = (float(depth),) + (0.0,) * (len(ranked) - 1)
        return self._decision(view, ranked, reason, scores)

    def _cheaper_elsewhere(
        self,
        request: RouteRequest,
        keys: list[tuple[int, int]],
        saving_tokens: float,
        home: int,
        loads: np.ndarray,
        view: FleetView,
    ) -> int:
        """The least-loaded eligible engine if the request is mostly not cached at its
        home and the home's extra load costs more tokens than the cached part saves,
        else -1.

        The saving is :meth:`_saving_tokens`; the extra queue is the home's queued tokens
        minus the least-loaded engine's, which must also exceed that engine's own load
        and ``stall_weight`` times the saving per request in flight there.
        """
        home_load = int(loads[home])
        if home_load <= saving_tokens:
            return -1  # no engine can be lighter by more than the saving
        least = view.selector.tree_least_loaded(
            keys[-1][1], request.row, loads, view.eligible(request.row)
        )
        if least < 0 or least == home:
            return -1
        if home_load - int(loads[least]) <= saving_tokens + int(loads[least]):
            return -1  # the spill must also pay for the queue it joins
        stall = self.stall_weight * saving_tokens * int(view.in_flight()[least])
        if home_load - int(loads[least]) <= saving_tokens + int(loads[least]) + stall:
            return -1  # and for the decodes its re-prefill stalls there
        return least

    def _last_placement(
        self,
        view: FleetView,
        request: RouteRequest,
        keys: list[tuple[int, int]],
        group_depth: int,
        decided: int,
        loads: np.ndarray,
        mask: np.ndarray,
    ) -> tuple[int, int]:
        """The engine the deepest seen depth below ``group_depth`` was last sent to and
        that depth, if it is eligible, not ``decided`` and within the load bound less the
        saving there; else ``(-1, 0)``."""
        for d, key in reversed(keys):
            if d <= group_depth:
                break
            if self.seen.share(key) > 0.0:
                ids = [int(x) for x in view.selector.engine_ids]
                engine = self.seen.engine(key)
                placed = ids.index(engine) if engine in ids else -1
                if placed < 0 or not mask[placed] or placed == decided:
                    break
                slack = int(self.affinity_slack * (d / BYTES_PER_TOKEN))
                if not view.selector.tree_within_bound(
                    placed, request.row, loads, self.balance_factor, mask, slack
                ):
                    break
                return placed, d
        return -1, 0

    def _saving_tokens(self, keys: list[tuple[int, int]], depth: int) -> float:
        """The deepest depth of this request in the seen table (every depth of every routed
        request: a prefix sent recently), at least ``depth``, in tokens at
        ``BYTES_PER_TOKEN``."""
        seen = depth
        for d, key in reversed(keys):
            if d <= seen:
                break
            if self.seen.share(key) > 0.0:
                seen = d
                break
        return seen / BYTES_PER_TOKEN

    def _candidates(
        self, keys: list[tuple[int, int]], mask: np.ndarray, route: tuple[int, int]
    ) -> list[tuple[int, int]]:
        """The keys to try, in order: those of groups that are not hot (else the deepest)."""
        hot = self.hot
        n_eligible = int(np.count_nonzero(mask))
        deepest, keys_by_depth = keys[-1], keys
        self._every_hot = False
        if n_eligible > 1 and hot.requests < 2 * n_eligible:
            # Too few observations to tell a share from noise: the most specific key.
            first = route if route in keys else deepest
            deep = self.order == "deep"
            self._observe_upto = len(keys) if deep else min(len(keys), MAX_CANDIDATES)
            return [first] if first == deepest else [first, deepest]
        if self.order == "deep":
            keys = keys[::-1]
        if n_eligible > 1:
            enter = self.hot_share_factor / n_eligible
            leave = enter * HOT_LEAVE_RATIO
            cold = []
            for kd in keys:
                if not hot.is_hot(kd[1], enter, leave):
                    cold.append(kd)
                    if len(cold) == MAX_CANDIDATES:
                        break
            self._every_hot = not cold
            keys = cold or keys[-1:]
        else:
            keys = keys[:MAX_CANDIDATES]
        # on_routed observes through the deepest candidate's next depth.
        self._observe_upto = (
            len(keys_by_depth)
            if self.order == "deep"
            else 1 + max((i for i, kd in enumerate(keys_by_depth) if kd in keys), default=0)
        )
        # The bounded fallback ranks by the last candidate: make it the most specific key,
        # so requests that all share the candidates' prefixes do not herd onto one engine.
        if keys[-1] != deepest:
            keys = [*keys, deepest]
        return keys

    def on_routed(self, request: RouteRequest, engine_id: int) -> None:
        last, keys = self._last
        upto = self._observe_upto
        if last is not request:
            keys, upto = [h for _, h in self.keys(request)], _ALL
        # Shares matter down to the first group that is not hot and its sub-group:
        # deeper keys start counting when their parent becomes hot. One request counts
        # one (requests, not tokens: the fourth re-record).
        self.hot.observe(keys[: upto + 1], 1.0)
        self.seen.observe(keys, 1.0, engine_id)
        whole = self._whole_last if last is request else None
        self.wholes.observe([] if whole is None else [whole], 1.0)

    def reset(self) -> None:
        self.hot.reset()
        self.seen.reset()
        self._last = (None, [])
        self._observe_upto = _ALL
        self._every_hot = False
        self._repeats = 0
        self.wholes = HotKeys(16.0)
        self._wholes_engines = 1
        self._whole_last = None

    def __repr__(self) -> str:
        return (
            f"<ReferencePrefixHRW block_bytes={self.block_bytes} prefix_bytes={self.prefix_bytes} "
            f"balance_factor={self.balance_factor} hot_share_factor={self.hot_share_factor} "
            f"hot_half_life_requests={self.hot_half_life_requests} order={self.order!r}>"
        )
