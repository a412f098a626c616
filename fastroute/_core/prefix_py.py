"""The ``prefix-hrw`` decision: the pure-Python specification of ``prefix.pyx``.

This module is the spec of the compiled per-request work of the default policy
(``fastroute/policy/prefix_hrw.py`` states the algorithm and its reasons): the depth
keys of a prompt prefix, the decayed share table that tells which prefix groups are
hot, the choice of candidate keys, the bounded ranking (``Selector.rank_prefix``) and
the cost spill (``Selector.least_loaded``). ``prefix.pyx`` computes exactly the same
decisions with one fused pass over the fleet in the common case; any divergence is a
bug, and ``tests/unit/test_prefix_core.py`` checks parity.

Share arithmetic, bit for bit in both implementations (a logical clock: one tick per
observed request, so the estimate reads no clock and replays identically): with
``decay = 0.5 ** (1 / half_life_requests)``, an observation of weight ``x`` at tick
``t`` sets ``total = total · decay + x`` and, per key, ``w = w · decay^(t - s) + x`` and
``s = t`` (``s`` the key's stamp); a key's share is ``w · decay^(t - s) / total``.

Memory is bounded: once more than ``max_keys`` keys are held, the keys whose decayed
weight is below ``total / max_keys`` are dropped (they cannot be hot); if more than
``max_keys // 2`` remain, so are those seen before the ``max_keys // 2`` most recently
seen (keys seen at the same tick go together).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import xxhash

from fastroute._core.selector_py import mix64
from fastroute._core.selector_tree import WALK_CAP

__all__ = [
    "DEFAULT_MAX_KEYS",
    "HOT_LEAVE_RATIO",
    "MAX_CANDIDATES",
    "MAX_DEPTH_KEYS",
    "MIN_BLOCK_BYTES",
    "REPEAT_HALF_LIFE_PER_ENGINE",
    "HotKeys",
    "PrefixPicker",
    "depth_keys",
    "whole_key",
]

_hash = xxhash.xxh3_64_intdigest

#: A hot group stays hot until its share falls below this fraction of the entry
#: threshold (hysteresis: a group near the threshold must not flip engines per request).
HOT_LEAVE_RATIO = 0.5

#: Candidate keys tried against the load bound: the first group that is not hot and
#: its first sub-group that is not hot (then the deepest key, whose rendezvous order the
#: bounded fallback uses). More candidates cost one O(n) ranking each and rarely change
#: the pick.
MAX_CANDIDATES = 2

#: Half-life of the whole prompts' share table, in this worker's requests per eligible
#: engine. A whole prompt's share is compared with the threshold ``h / n`` alone: it needs
#: no memory longer than its noise (a session's prompt grows, so its whole key never
#: repeats; the depth keys' long half-life is what keeps a busy session from being taken
#: for a hot group). At ``16 n`` requests a decayed count holds about ``2.9 · 16 n``
#: samples' worth, ``h / n`` of them at the threshold: 23 at ``h = 0.5``, whatever
#: ``n``, a relative error of about 20 %, which the hysteresis (leave at half) absorbs.
REPEAT_HALF_LIFE_PER_ENGINE = 16

#: Smallest ``block_bytes`` accepted: below it a depth key is mostly chat-template bytes.
MIN_BLOCK_BYTES = 64

#: Most keys of one request (depth keys and the routing key): the compiled core keeps
#: them in a fixed array. Doubling depths from 64 bytes reach 2**63 bytes in 57 keys.
MAX_DEPTH_KEYS = 64

#: Keys the share table holds before pruning.
DEFAULT_MAX_KEYS = 65536

#: ``on_routed`` of a request ``choose`` did not see last observes every key.
_ALL = 1 << 30


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


def whole_key(read: bytes, prompt_tokens: int) -> int:
    """The identity of a request's whole prompt: ``xxh3_64(read) ^ mix64(prompt_tokens)``,
    ``read`` the prompt's first ``prefix_bytes`` bytes. The token count tells a prompt
    that continues past the bytes read from another (a session's growing context from
    a long prompt sent again)."""
    return _hash(read) ^ mix64(prompt_tokens)


class HotKeys:
    """Exponentially decayed per-key shares of the observed weight.

    Parameters
    ----------
    half_life_requests : float
        Requests after which an observation counts half; > 0.
    max_keys : int
        Keys held before pruning; >= 16.
    """

    __slots__ = ("_decay", "_max_keys", "_t", "_total", "_counts")

    def __init__(self, half_life_requests: float, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if not half_life_requests > 0:
            raise ValueError(f"half_life_requests must be > 0, got {half_life_requests}")
        if max_keys < 16:
            raise ValueError(f"max_keys must be >= 16, got {max_keys}")
        self._decay = 0.5 ** (1.0 / float(half_life_requests))
        self._max_keys = int(max_keys)
        self._t = 0
        self._total = 0.0
        # key -> [weight as of stamp, stamp, 1.0 if hot at its last is_hot() else 0.0,
        #         engine id of its last observation, 0 if not known]
        self._counts: dict[int, list[Any]] = {}

    @property
    def requests(self) -> int:
        """Requests observed so far (the logical clock)."""
        return self._t

    def __len__(self) -> int:
        return len(self._counts)

    def observe(self, keys: Iterable[int], weight: float, engine_id: int = 0) -> None:
        """One request of weight ``weight`` (> 0) carried ``keys`` and was routed to
        ``engine_id`` (0: not known), which each key records (:meth:`engine`)."""
        t = self._t = self._t + 1
        decay = self._decay
        self._total = self._total * decay + weight
        counts = self._counts
        for key in keys:
            entry = counts.get(key)
            if entry is None:
                counts[key] = [weight, t, 0.0, engine_id]
            else:
                entry[0] = entry[0] * decay ** float(t - entry[1]) + weight
                entry[1] = t
                entry[3] = engine_id
        if len(counts) > self._max_keys:
            self._prune()

    def set_half_life(self, half_life_requests: float) -> None:
        """Decay by ``half_life_requests`` (> 0) from now on; the weights held keep their
        values as of their stamps."""
        if not half_life_requests > 0:
            raise ValueError(f"half_life_requests must be > 0, got {half_life_requests}")
        self._decay = 0.5 ** (1.0 / float(half_life_requests))

    def share(self, key: int) -> float:
        """The key's decayed share of the observed weight, in [0, 1]; 0 if unseen."""
        entry = self._counts.get(key)
        if entry is None or self._total <= 0.0:
            return 0.0
        return entry[0] * self._decay ** float(self._t - entry[1]) / self._total

    def engine(self, key: int) -> int:
        """The engine the last request that carried ``key`` was routed to; 0 if unseen or
        not known."""
        entry = self._counts.get(key)
        return 0 if entry is None else entry[3]

    def is_hot(self, key: int, enter_share: float, leave_share: float) -> bool:
        """Whether ``key``'s group is hot, with hysteresis: it becomes hot above
        ``enter_share`` and stays hot until its share falls below ``leave_share``, so a
        group near the threshold does not flip between engines request by request."""
        entry = self._counts.get(key)
        if entry is None or self._total <= 0.0:
            return False
        share = entry[0] * self._decay ** float(self._t - entry[1]) / self._total
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
        for key in [k for k, (w, s, *_) in counts.items() if w * decay ** float(t - s) < floor]:
            del counts[key]
        keep = self._max_keys // 2
        if len(counts) > keep:
            cutoff = sorted(entry[1] for entry in counts.values())[len(counts) - keep]
            for key in [k for k, entry in counts.items() if entry[1] < cutoff]:
                del counts[key]


class PrefixPicker:
    """The per-request work of ``prefix-hrw``: keys, candidates, bounded ranking, spill.

    Parameters
    ----------
    block_bytes, prefix_bytes, balance_factor, hot_share_factor, hot_half_life_requests
        The policy's tunables (validated by the policy).
    affinity_slack : float
        The policy's tunable: how far (in units of the request's saving) the first
        candidate's home may be above the load bound and keep the request.
    stall_weight : float
        The policy's tunable: leaving the home (the load bound's yield, the cost spill)
        pays this times the saving per request in flight where the request would go (the
        decodes the re-prefill stalls there).
    deep : bool
        Try the deepest key first (``order = "deep"``).
    bytes_per_token : float
        Prompt bytes per token, to turn a cached depth into tokens saved.
    max_keys : int
        Keys the share table holds before pruning.
    """

    def __init__(
        self,
        block_bytes: int,
        prefix_bytes: int,
        balance_factor: float,
        hot_share_factor: float,
        hot_half_life_requests: float,
        deep: bool = False,
        bytes_per_token: float = 4.0,
        max_keys: int = DEFAULT_MAX_KEYS,
        affinity_slack: float = 1.0,
        stall_weight: float = 0.0,
    ) -> None:
        self.block_bytes = int(block_bytes)
        self.prefix_bytes = int(prefix_bytes)
        self.balance_factor = float(balance_factor)
        self.affinity_slack = float(affinity_slack)
        self.stall_weight = float(stall_weight)
        self.hot_share_factor = float(hot_share_factor)
        self.deep = bool(deep)
        self.bytes_per_token = float(bytes_per_token)
        self.hot = HotKeys(hot_half_life_requests, max_keys)
        # Every depth of every routed request, for the cost spill's saving only: the share
        # table observes a request's depths only through its deciding key's next, so it
        # read a 3 k-token document's cached prefix as 512 tokens.
        self.seen = HotKeys(hot_half_life_requests, max_keys)
        # Whole prompts' shares (repeats spread): the host's, through the key log (not the
        # other proxies'); its half-life follows the most eligible engines a decision saw
        # (REPEAT_HALF_LIFE_PER_ENGINE).
        self.wholes = HotKeys(REPEAT_HALF_LIFE_PER_ENGINE, max_keys)
        self._wholes_engines = 1
        # The last decided request, its key hashes, how many of them on_routed observes
        # and its whole key (None: not counted).
        self._last: tuple[Any, list[int], int, int | None] = (None, [], _ALL, None)
        # Decisions that spread a hot repeated prompt (the next one's turn among replicas).
        self._repeats = 0
        #: The host's key log (``fastroute._core.keylog_py.KeyLog``), or None.
        self.log: Any = None

    def attach_log(self, log: Any) -> None:
        """Share observations through ``log``, a ``KeyLog``: drain the host's other
        workers' routed keys into this picker's tables before each decision, publish its
        own after each ``on_routed`` (None: this worker's own only). The log's recent
        entries (up to its capacity: a worker that starts or reloads) are replayed now,
        not in the first decision (a full 4096-entry log takes a few ms)."""
        self.log = log
        if log is not None:
            log.drain(self.hot, self.seen, self.wholes)

    def keys(
        self, prefix: bytes, key_hash: int, key_depth_bytes: int, prompt_tokens: int = 0
    ) -> list[tuple[int, int]]:
        """The request's ``(depth_bytes, key)`` pairs, shallow first.

        The depth keys of ``prefix[:prefix_bytes]``, with the routing key inserted after
        the depths ``<= key_depth_bytes`` when that is ``>= 0``, else the whole prompt's
        key (:func:`whole_key`, at the depth of the bytes read) after them: without a
        conversation key to mark where the request's own part begins, the whole prompt
        is its deepest group. ``[(0, key_hash)]`` when the prefix is shorter than one
        block.
        """
        read = prefix[: self.prefix_bytes]
        keys = depth_keys(read, self.block_bytes)
        if key_depth_bytes >= 0 and keys:
            at = 0
            while at < len(keys) and keys[at][0] <= key_depth_bytes:
                at += 1
            keys.insert(at, (key_depth_bytes, key_hash))
        elif keys:
            keys.append((len(read), self._whole_key(read, prompt_tokens, keys, key_depth_bytes)))
        return keys or [(0, key_hash)]

    def _whole_key(
        self, read: bytes, prompt_tokens: int, keys: list[tuple[int, int]], key_depth_bytes: int
    ) -> int:
        """:func:`whole_key`, reusing the deepest depth key's hash (the routing key at
        ``key_depth_bytes`` left out) when that depth is the whole of ``read`` (a prompt of
        a power of two blocks, or one cut at ``prefix_bytes``)."""
        depths = [kd for kd in keys if kd[0] >= self.block_bytes and kd[0] != key_depth_bytes]
        if depths and depths[-1][0] == len(read):
            return depths[-1][1] ^ mix64(prompt_tokens)
        return whole_key(read, prompt_tokens)

    def choose(
        self,
        selector: Any,
        request: Any,
        mask: np.ndarray,
        loads: Any,
        k: int,
        in_flight: Callable[[], Any] | None = None,
        prefill_cost: Any = None,
    ) -> tuple[list[int], str, int, int]:
        """Decide ``request`` (a ``RouteRequest``) over ``mask`` (its row's eligible
        engines) and ``loads`` (int64 per engine); ``in_flight`` returns the requests in
        flight per engine (int64), called only when the request would leave its home (None:
        none counted); ``prefill_cost`` is each engine's time per prefilled token relative
        to the fastest engine's (float64, every value >= 1), which the cost spill weighs
        its terms by (None: all engines alike).

        Returns
        -------
        (list of int, str, int, int)
            The failover ranking (empty when no engine is eligible), the reason, the
            depth in bytes of the key that decided (-1 for the bounded fallback and the
            cost spill) and the prompt tokens expected cached at ``ranked[0]``: the
            saving the rules counted there (:meth:`_saving_tokens`, truncated to an
            integer), 0 for the bounded fallback and the cost spill.
        """
        if self.log is not None:
            self.log.drain(self.hot, self.seen, self.wholes)
        keys = self.keys(
            request.prefix, request.key_hash, request.key_depth_bytes, request.prompt_tokens
        )
        route = (request.key_depth_bytes, request.key_hash)
        n_eligible = selector.tree_size(request.row, mask)
        candidates, upto, every_hot = self._candidates(keys, n_eligible, route)
        repeat, whole, turn = None, None, -1
        if request.key_depth_bytes != 0:  # a declared session keeps its home
            whole = self._request_whole_key(request, keys, every_hot)
            if every_hot:
                upto = len(keys)
            repeat, turn = self._repeat(
                whole, min(len(request.prefix), self.prefix_bytes), n_eligible
            )
            if repeat is not None:
                candidates, upto = [repeat], len(keys)
        self._last = (request, [h for _, h in keys], upto, whole)
        cold = self._cold(n_eligible)
        # The first candidate's home may exceed the bound by what staying there saves.
        home_saving = self._saving_tokens(keys, 0 if cold else candidates[0][0])
        ranked, used = self._bounded_rank(
            selector,
            request.row,
            [h for _, h in candidates],
            k,
            loads,
            mask,
            home_saving,
            in_flight,
        )
        if not ranked:
            return ranked, "", -1, 0
        if turn >= 0:
            ranked = self._replica(
                selector, request.row, candidates[0][1], turn, ranked, k, loads, mask
            )
        bounded = used >= len(candidates)
        if bounded:
            reason, depth, saving = "bounded-spill", -1, 0.0
        else:
            depth = candidates[used][0]
            reason = "prefix-home" if used == 0 else "prefix-spill"
            if repeat is not None:
                reason = "repeat-spread"
            elif len(request.prefix) < self.block_bytes:
                reason = "no-prefix"
            # Cold: the deciding key was not chosen for its cache, so the saving is only
            # what the seen table holds.
            saving = home_saving if used == 0 else self._saving_tokens(keys, 0 if cold else depth)
            if depth == 0 and request.key_depth_bytes == 0:
                return ranked, reason, depth, int(saving)  # the client's session: never spilled
        placed, placed_depth = self._last_placement(
            selector, request.row, keys, candidates[0][0], ranked[0], loads, mask
        )
        if placed >= 0:
            ranked = [placed, *(i for i in ranked if i != placed)][:k]
            reason, depth = "prefix-follow", placed_depth
            saving = placed_depth / self.bytes_per_token
        elif bounded:
            return ranked, reason, depth, 0
        if prefill_cost is None:
            least = self._cheaper_elsewhere(
                selector, request.row, keys, saving, ranked[0], loads, mask, in_flight
            )
        else:
            least = self._cheaper_in_time(
                keys[-1][1], saving, ranked[0], loads, mask, in_flight, prefill_cost
            )
        if least < 0:
            return ranked, reason, depth, int(saving)
        return [least, *(i for i in ranked if i != least)][:k], "cost-spill", -1, 0

    def _bounded_rank(
        self,
        selector: Any,
        row: int,
        candidate_keys: list[int],
        k: int,
        loads: Any,
        mask: np.ndarray,
        home_saving: float,
        in_flight: Callable[[], Any] | None,
    ) -> tuple[list[int], int]:
        """``Selector.tree_rank_prefix`` with the first home's slack: ``a · saving``, and
        when that still sends the request elsewhere (engine ``t``), also what leaving
        costs the decodes at ``t``, ``w · saving · n_t`` (the cost spill's stall; ranked
        again with the larger slack)."""
        slack = int(self.affinity_slack * home_saving)
        ranked, used = selector.tree_rank_prefix(
            candidate_keys, row, k, loads, self.balance_factor, mask, slack
        )
        if not ranked or used == 0 or in_flight is None or self.stall_weight <= 0.0:
            return ranked, used
        stall = int(self.stall_weight * home_saving * int(in_flight()[ranked[0]]))
        if stall <= 0:
            return ranked, used
        return selector.tree_rank_prefix(
            candidate_keys, row, k, loads, self.balance_factor, mask, slack + stall
        )

    def _cheaper_elsewhere(
        self,
        selector: Any,
        row: int,
        keys: list[tuple[int, int]],
        saving_tokens: float,
        home: int,
        loads: Any,
        mask: np.ndarray,
        in_flight: Callable[[], Any] | None,
    ) -> int:
        """The least-loaded eligible engine ``t`` if the home's extra queue over it pays
        for the cached prefix, for ``t``'s own queue and for the decodes the re-prefill
        stalls at ``t``, else -1: ``L_home - L_t > saving + L_t + w · saving · n_t``.

        All terms are prompt tokens to prefill, the policy's loads (queued prompt tokens:
        prefill work a new request waits behind); the saving is :meth:`_saving_tokens`.
        ``L_t`` stands for what the spill costs the others: the spilled request prefills
        the saving again at ``t`` and delays by that much whatever queues behind it there
        (in a burst, when every engine has a queue, the re-prefills spend capacity the
        fleet does not have). ``n_t`` is the requests in flight at ``t`` (``in_flight()``,
        read only here; 0 without it): each waits out the re-prefilled saving between two
        of its tokens, weighed ``w = stall_weight`` against the spilled request's own wait.
        """
        home_load = int(loads[home])
        if home_load <= saving_tokens:
            return -1  # no engine can be lighter by more than the saving
        least = selector.tree_least_loaded(keys[-1][1], row, loads, mask)
        if least < 0 or least == home:
            return -1
        target_load = int(loads[least])
        gain = float(home_load - target_load)
        return self._spill_pays(least, gain, target_load, 1.0, saving_tokens, in_flight)

    def _cheaper_in_time(
        self,
        key: int,
        saving_tokens: float,
        home: int,
        loads: Any,
        mask: np.ndarray,
        in_flight: Callable[[], Any] | None,
        prefill_cost: Any,
    ) -> int:
        """:meth:`_cheaper_elsewhere` on a fleet whose engines prefill at different speeds:
        every term in prefill time, each engine's tokens times its ``r_e``
        (``prefill_cost``, the fastest engine's token = 1). ``t`` is the eligible engine
        other than the home where the request would start soonest, the least
        ``(L_e + saving) · r_e`` (ties by the least ``mix64(key ^ e)``, ``key`` the deepest
        key's hash); the request goes there iff
        ``L_home · r_home - L_t · r_t > (saving + L_t + w · saving · n_t) · r_t``. With
        every ``r_e = 1`` it is the same test as :meth:`_cheaper_elsewhere`; ``t`` is then
        one of the least loaded engines, maybe another one than that method's.

        One pass over the fleet (O(n)), only when the home's queue takes longer than the
        saving's prefill on the fastest engine (no engine can be cheaper otherwise)."""
        home_s = int(loads[home]) * float(prefill_cost[home])
        if home_s <= saving_tokens:
            return -1
        least, least_s, least_tie = -1, math.inf, 0
        for e in np.flatnonzero(mask):
            e = int(e)
            if e == home:
                continue
            start_s = (int(loads[e]) + saving_tokens) * float(prefill_cost[e])
            tie = mix64(key ^ e)
            if start_s < least_s or (start_s == least_s and tie < least_tie):
                least, least_s, least_tie = e, start_s, tie
        if least < 0:
            return -1
        target_load, rate = int(loads[least]), float(prefill_cost[least])
        gain_s = home_s - target_load * rate
        return self._spill_pays(least, gain_s, target_load, rate, saving_tokens, in_flight)

    def _spill_pays(
        self,
        target: int,
        gain: float,
        target_load: int,
        rate: float,
        saving_tokens: float,
        in_flight: Callable[[], Any] | None,
    ) -> int:
        """``target`` if leaving for it gains more than it costs, else -1: ``gain`` (the
        home's queue less the target's, in the target's unit) against the re-prefilled
        saving and the queue it joins, then also the decodes it stalls there, each times
        ``rate`` (the target's prefill time per token; 1 in tokens). ``in_flight`` is read
        only when the first test passes and the stall can count."""
        if gain <= (saving_tokens + target_load) * rate:
            return -1  # the gain does not pay for the queue the request joins
        if in_flight is None or self.stall_weight <= 0.0 or saving_tokens <= 0.0:
            return target
        stalled = int(in_flight()[target])
        if (
            gain
            <= (saving_tokens + target_load + self.stall_weight * saving_tokens * stalled) * rate
        ):
            return -1  # nor for the decodes its re-prefill stalls there
        return target

    def _last_placement(
        self,
        selector: Any,
        row: int,
        keys: list[tuple[int, int]],
        group_depth: int,
        decided: int,
        loads: Any,
        mask: Any,
    ) -> tuple[int, int]:
        """Where the deepest prefix of this request that the seen table holds was last
        sent, when that is deeper than ``group_depth`` (the first candidate key's depth),
        known, eligible, not ``decided`` and within the load bound less what going there
        saves (rule 2's first home): ``(engine index, depth in bytes)``, else ``(-1, 0)``.
        A spill places a group's prefix away from its rendezvous home; the requests that
        extend it find it there, not at the home."""
        at = self._deepest_seen(keys, group_depth)
        if at < 0:
            return -1, 0
        d, key = keys[at]
        engine_id = self.seen.engine(key)
        placed = selector.eligible_index(engine_id, row, mask) if engine_id else -1
        slack = int(self.affinity_slack * (d / self.bytes_per_token))
        if (
            placed < 0
            or placed == decided
            or not selector.tree_within_bound(placed, row, loads, self.balance_factor, mask, slack)
        ):
            return -1, 0
        return placed, d

    def _deepest_seen(self, keys: list[tuple[int, int]], above_depth: int) -> int:
        """The index in ``keys`` of the deepest key deeper than ``above_depth`` that the
        seen table holds (a routed request sent that prefix recently), else -1."""
        for at in range(len(keys) - 1, -1, -1):
            d, key = keys[at]
            if d <= above_depth:
                break
            if self.seen.share(key) > 0.0:
                return at
        return -1

    def _saving_tokens(self, keys: list[tuple[int, int]], depth: int) -> float:
        """The prefill, in tokens, that going to the deciding key's home saves: the
        deepest depth of this request the seen table holds (a routed request sent that
        prefix recently), at least ``depth`` (the deciding key's, 0 when cold)."""
        at = self._deepest_seen(keys, depth)
        return (depth if at < 0 else keys[at][0]) / self.bytes_per_token

    def _cold(self, n_eligible: int) -> bool:
        """Too few observations (under 2 per eligible engine) to tell a share from noise;
        with one eligible engine there is nothing to choose."""
        return n_eligible > 1 and self.hot.requests < 2 * n_eligible

    def _candidates(
        self, keys: list[tuple[int, int]], n_eligible: int, route: tuple[int, int]
    ) -> tuple[list[tuple[int, int]], int, bool]:
        """The keys to try, in order (those of groups that are not hot, else the deepest),
        how many of ``keys`` ``on_routed`` observes and whether every key is hot
        (``n_eligible``: the row's eligible engines; ``route``: the routing key's
        ``(depth, hash)``)."""
        hot = self.hot
        deepest, order = keys[-1], keys[::-1] if self.deep else keys
        # Cold: the routing key (a session, a conversation) if it is one of the keys, else
        # the most specific key, so a cold worker spreads like plain rendezvous instead of
        # sending every request to the shared root's home (eight fresh workers did that
        # with one hot prompt). It observes what it did before the rule (the first two
        # keys' groups).
        if self._cold(n_eligible):
            first = route if route in keys else deepest
            upto = len(keys) if self.deep else 1 + min(len(keys), MAX_CANDIDATES)
            return ([first] if first == deepest else [first, deepest]), upto, False
        every_hot = False
        if n_eligible > 1:
            enter = self.hot_share_factor / n_eligible
            leave = enter * HOT_LEAVE_RATIO
            cold = []
            for kd in order:
                if not hot.is_hot(kd[1], enter, leave):
                    cold.append(kd)
                    if len(cold) == MAX_CANDIDATES:
                        break
            every_hot = not cold
            chosen = cold or order[-1:]
        else:
            chosen = order[:MAX_CANDIDATES]
        # Observe through the deepest candidate's next depth: deeper keys start counting
        # when their parent becomes hot.
        last = max((i for i, kd in enumerate(keys) if kd in chosen), default=0)
        upto = len(keys) if self.deep else 2 + last
        # The bounded fallback ranks by the last candidate: make it the most specific key,
        # so requests that all share the candidates' prefixes do not herd onto one engine.
        if chosen[-1] != deepest:
            chosen = [*chosen, deepest]
        return chosen, upto, every_hot

    def _request_whole_key(self, request: Any, keys: list[tuple[int, int]], every_hot: bool) -> int:
        """The request's whole key (:meth:`_whole_key`): a completion's deepest key, else
        computed, and appended to ``keys`` when every key is hot, so that the share and
        seen tables count it with them (rule 1: the whole key is the deepest group of a
        request none of whose groups can split it)."""
        read = request.prefix[: self.prefix_bytes]
        if request.key_depth_bytes < 0 and len(read) >= self.block_bytes:
            return keys[-1][1]  # already their last (keys)
        whole = self._whole_key(read, request.prompt_tokens, keys, request.key_depth_bytes)
        if every_hot:
            keys.append((len(read), whole))
        return whole

    def _repeat(
        self, whole: int, depth: int, n_eligible: int
    ) -> tuple[tuple[int, int] | None, int]:
        """Repeats spread (rule 1): when the whole prompt ``whole`` is hot in the whole
        prompts' share table (one prompt sent by many: a load test, a fixed instruction), no
        key can split its group and any engine caches it for one prefill, so it is given
        ``r = ceil(share / (h / n))`` replicas, as many as keep each at most a hot group's
        share, and the requests take them in turn (this picker's count of such decisions).
        ``((depth, key), turn)``: the key ``whole`` and the turn among the first ``r`` of its
        ranking (:meth:`_replica`); past :data:`WALK_CAP` replicas, the key salted with the
        turn and -1 (``r`` salted homes: the walk would cost more than the few homes the
        salts share save). ``(None, -1)`` when not hot."""
        if n_eligible < 2 or self._cold(n_eligible):
            return None, -1
        if n_eligible > self._wholes_engines:
            self._wholes_engines = n_eligible
            self.wholes.set_half_life(REPEAT_HALF_LIFE_PER_ENGINE * n_eligible)
        enter = self.hot_share_factor / n_eligible
        if not self.wholes.is_hot(whole, enter, enter * HOT_LEAVE_RATIO):
            return None, -1
        self._repeats += 1
        replicas = max(1, min(n_eligible, math.ceil(self.wholes.share(whole) / enter)))
        turn = self._repeats % replicas
        if replicas > WALK_CAP:
            return (depth, whole ^ mix64(1 + turn)), -1
        return (depth, whole), turn

    def _replica(
        self,
        selector: Any,
        row: int,
        whole: int,
        turn: int,
        ranked: list[int],
        k: int,
        loads: Any,
        mask: np.ndarray,
    ) -> list[int]:
        """``ranked`` (the whole key's bounded ranking, at most ``k``) led by the engine at position
        ``turn`` of the whole key's ranking when that one is within rule 2's bound."""
        target = selector.tree_rank(whole, row, turn + 1, mask)[-1]
        if target == ranked[0] or not selector.tree_within_bound(
            target, row, loads, self.balance_factor, mask, 0
        ):
            return ranked
        return [target, *(i for i in ranked if i != target)][:k]

    def on_routed(self, request: Any, engine_id: int = 0) -> None:
        """``request`` was sent to ``engine_id`` (0: not known): count it, one request,
        for its keys' shares, and record the engine as its keys' last placement.

        Requests, not tokens: a request that finds its group's prefix cached costs its
        home its own tail and decode, not the prefix, so by prompt tokens one long agent
        session (prompts of 10-26 k tokens, mostly cached) weighed like a popular group,
        went hot, and its later steps were routed by deeper keys, away from its cache.
        """
        last, keys, upto, whole = self._last
        if last is not request:
            whole = None
            keys = [
                h
                for _, h in self.keys(
                    request.prefix, request.key_hash, request.key_depth_bytes, request.prompt_tokens
                )
            ]
            upto = _ALL
        self.hot.observe(keys[:upto], 1.0)
        self.seen.observe(keys, 1.0, engine_id)
        self.wholes.observe(() if whole is None else (whole,), 1.0)  # every request counts
        if self.log is not None:
            self.log.publish(keys, min(upto, len(keys)), engine_id, whole)

    def reset(self) -> None:
        """Forget every observation."""
        self.hot.reset()
        self.seen.reset()
        self.wholes.reset()
        self.wholes.set_half_life(REPEAT_HALF_LIFE_PER_ENGINE)
        self._wholes_engines = 1
        self._last = (None, [], _ALL, None)
        self._repeats = 0
