"""``prefix-hrw``: rendezvous homes of the prompt's prefix depths, hot groups spread,
under a token-load bound (the default policy).

Algorithm
    Let ``P`` be the leading bytes of the request's rendered prompt (at most
    ``prefix_bytes``) and ``b = block_bytes``. The request's **depth keys** are
    ``h_j = xxh3_64(P[:b·2^j])`` for ``j = 0, 1, …`` while ``b·2^j <= len(P)``, plus the
    routing key where it is itself a prefix (chat: the messages through the first user
    message, at that depth; a session id the client sent, at depth 0), sorted by depth;
    a request whose routing key is not a prefix (a completion prompt) has instead its
    **whole key** ``xxh3_64(P) ^ mix64(prompt_tokens)`` at depth ``len(P)`` as its
    deepest: without a conversation key to mark where its own part begins, the whole
    prompt is its deepest group (completion prompts that share a hot 2 kB prefix and
    differ only below the next depth had no key to split by: every engine but the
    prefix's home idle in the simulator's `hot-prompt` family).
    Two requests that share a leading prefix of ``s`` bytes share every depth key up to
    ``s``, whatever follows, so a depth key names a **group** of requests that can reuse
    one KV-cache prefix, and its weighted rendezvous **home** (hierarchical rendezvous,
    ``Selector.tree_rank``: ``fastroute/_core/selector_tree.py``, docs/algorithms.md
    §2.7) is where that prefix is cached once one of them ran there.
    A prompt with no depth key (shorter than ``b``) uses the routing key alone.

    1. **Hot groups are skipped.** A group is hot when its decayed share of the recent
       requests (:class:`~fastroute._core.prefix_py.HotKeys`, half-life
       ``hot_half_life_requests``) exceeds ``h / n``, ``h = hot_share_factor`` times the
       mean engine share over the row's ``n`` eligible engines: more than its home may
       carry (it stays hot until its share falls below half that: hysteresis). Requests,
       not tokens: a request that finds its group's prefix cached costs the home its own
       tail and decode, not the prefix (by prompt tokens, one long agent session weighed
       like a popular group and was split away from its cache; the queue a long uncached
       prompt makes is the load bound's and the cost spill's business). The
       request is routed by the shallowest depth key that is not hot (the deepest key if
       all are), so a hot prefix (one system prompt for everybody, one RAG document)
       spreads over the homes of its sub-groups, each of which stays together. Until the
       worker has routed ``2 n`` requests no share can be told from noise: the request is
       ranked by its routing key when that is one of its keys, else by its deepest key,
       so that a fresh worker spreads a prefix everybody shares instead of sending it all
       to the root's home (the share estimate observes the same keys as afterwards).
       **Repeats spread.** A request that is not a declared session has a whole key
       (a chat's is counted with its depth keys, appended as the deepest, only when
       every other key is hot). Whether a whole prompt is hot is told by a share table
       of its own (``PrefixPicker.wholes``, the host's through the key log), in which
       every routed request counts, with a half-life of ``16 n`` requests
       (``REPEAT_HALF_LIFE_PER_ENGINE``; ``n`` the most eligible engines a decision
       saw): a growing session never repeats its whole key, so the whole prompts need
       no memory longer than the share's noise, while the depth keys' long memory is
       what keeps a busy session whole (and it held a new prompt sent by many on one
       home for its first ~490 requests). A hot whole prompt (one prompt sent by many:
       a load test, a fixed instruction template) gets ``r = ceil(share / (h / n))``
       replicas, as many as keep each at most a hot group's share: the first ``r``
       engines of its whole key's ranking, taken in turn by the worker's count of such
       decisions, each when within rule 2's bound (reason ``"repeat-spread"``); past
       ``WALK_CAP`` = 64 replicas, ``r`` salted homes. No deeper key can split such a
       group, every replica caches the prompt for one prefill, and with nothing left
       to prefill its decodes are invisible to rule 2's load (five prompts repeated, in
       the simulator at 3x nominal without the shed: 61.3 req/s before the spread, 70.9
       with it, 76.1 with its own table and replicas, round robin's 76.1; on 16 engines
       303 against round robin's 284 with a TTFT p99 of 1.4 s against 12 s;
       docs/fleet-benchmark.md, "Prompts sent again and again"). A session whose prompt
       grows is never hot at its whole key (the token count changes), so it keeps its
       engine; a session id the client declared is not spread.
    2. **Load bound.** The load ``L_e`` of an engine is its **queued prompt tokens**: the
       prompts of the attempts in flight to it from this host (all workers: the shared
       stats block), and from the deployment's other proxies when ``proxy.peers`` lists
       them (polled, :mod:`fastroute.proxy.background.peer_queues`; without it each of
       ``p`` proxies sees about ``1/p`` of every queue), that have not produced their first
       token (or, for a JSON answer, ended) yet, each less the prefix its decision expected
       cached there (``Decision.cached_tokens``: the saving of rule 4 at the chosen
       engine, 0 after a spill) but at least ``f = queued_floor_tokens`` of it (the whole
       prompt if shorter), the prefill a new request waits behind; a view that does not
       track them gives in-flight tokens (prompt + output budget), else in-flight
       requests. The floor because a request whose prompt is cached still needs an
       engine slot: when the slots are full it waits for a running decode to end, and at
       one token each a queue of such requests was invisible to the bound (five prompts
       repeated at 3x nominal: 60.1 req/s of goodput and a TTFT p99 of 11 s in the
       simulator, round robin 76.1 and 0.3 s; 70.9 and 3.8 s with the floor).
       Net of the cache because a returning session's cached prefix is no work: counted
       whole, two or three cached 5 k-token chat turns put a home over its bound and 18 %
       of consecutive chat turns changed engine through the fleet at 90 % (5 % net of it).
       Over the row's eligible engines ``E`` with LP weights ``w``, an engine is within
       bound iff ``L_e / Σ_E L <= c · w_e / Σ_E w``; the first candidate's home iff
       ``(L_e - a · S) / Σ_E L <= c · w_e / Σ_E w``, ``S`` the request's saving there
       (rule 4's estimate, tokens) and ``a = affinity_slack``: a bound that ignores what
       affinity saves spilled a cached agent session off its home for one queued long
       prompt on a lightly loaded fleet, to re-prefill its whole context elsewhere and
       come back next turn (docs/history/2026-12-fleet-benchmark-default-policy.md,
       "Sessions that change engine"). When that ranking still sends the request away
       from the first home, to engine ``t``, leaving re-prefills the saving at ``t`` as a
       cost spill would: the slack also takes rule 4's stall there, ``w · S · n_t``, and
       the candidates are ranked again with it (past saturation on shared documents the
       bound's spills re-prefilled as the cost spill's did: `rag` at 4x nominal 16.8 →
       20.3 req/s in the simulator with it, the cost spill's stall already priced). The
       request goes to the first key's home that is within bound, trying the candidate
       keys in order; if none is, to the
       first within-bound engines of the last key's ranking (at least a ``1 - 1/c`` share
       of the weight is within bound, so this walk is short; it stops after
       ``WALK_CAP = 64`` positions). The failover ranking is the ranking of the key that
       decided (``Selector.tree_rank_prefix``). ``L_e`` is read live; ``Σ_E L`` is kept
       in chunks of 256 engines of which one is re-read per decision (exact up to 256
       engines; at ``n`` engines at most ``n / 256`` decisions old). Its relative error
       is the load change over that many of this worker's decisions against the total:
       a few per mille on 10,000 busy engines, where the bound tolerates a 100 % excess
       at ``c = 2``; large only on a nearly idle fleet, where a low total spills a few
       requests early.
       Why queued prompts and not in-flight tokens: a decoding context costs a new
       request one slot in the batch, a queued prompt costs it that prompt's whole
       prefill before its first token. In-flight tokens count a long decode as if it
       were queued prefill, so a cached home looked loaded when it was not and a busy
       one looked light (docs/history/2026-12-fleet-benchmark-default-policy.md,
       "Load in queued prompt tokens").
    3. **Last placement.** The deepest depth of the request that the **seen table** (rule
       4) holds, when it is deeper than the first candidate key's (the group's), was last
       sent to engine ``p`` (the seen table records, per key, the engine of the last
       routed request that carried it: this host's workers' through the key log, the
       other proxies' through the key exchange). When ``p`` is not the engine rules 1-2
       chose, is eligible and is within the bound less its saving there (rule 2's first
       home: ``(L_p - a · S_p) / Σ_E L <= c · w_p / Σ_E w``, ``S_p`` that depth in
       tokens), the request goes to ``p`` (reason ``"prefix-follow"``, saving ``S_p``),
       and rule 4 decides from there. A spill (rule 2's or rule 4's) places a prefix away
       from its rendezvous home, and the home does not hold what the request extends (a
       conversation's last turn, a document's deeper blocks): without this, the turns and
       questions that followed a spilled one went home and prefilled it again, so a spill
       cost its saving twice (past saturation on shared documents, `rag` at 4x nominal
       20.3 → 25.4 req/s in the simulator without the shed, `cache-aware` 26.2; `bursts`
       19.8 → 23.3; the Mooncake trace at 1.5x 1.21 → 1.29; docs/fleet-benchmark.md,
       "Where the prefix went"). Only depths below the group's key: the group's own
       prefix (a system prompt, a hot document's shared part) is cached at its home or
       spread on purpose (rule 1), and following its last placement would herd the group.
       No new tunable: the bound and its slack are rule 2's. A session id the client
       declared is not moved (its home is the session's).
    4. **Cost spill.** Affinity is worth the prefill it saves, and a queue costs the
       prefill queued ahead: both are prompt tokens. The saving is estimated as the
       deepest depth of this request that a **seen table** holds (at least the deciding
       key's depth), in tokens: a decayed count of every depth of every routed request,
       half-life as the shares' (the share estimate observes a request's depths only
       through its deciding key's next one, so it read a 3 k-token document's cached
       prefix as 512 tokens and spilled it on a short queue; after rule 3, the followed
       depth). With ``home`` the engine rules 1-3 chose and ``t`` the least-loaded
       eligible engine (ties by the deepest key's rendezvous order), the request goes to
       ``t`` (reason ``"cost-spill"``) iff ``L_home - L_t > saving + L_t``: the gain must
       pay for the prefix it prefills again and for the queue it joins. ``L_t`` stands
       for what the spill costs the others: the re-prefilled saving delays whatever
       queues behind it at ``t``, and when every engine has a queue (a burst) those
       re-prefills spend capacity the fleet does not have. Unshared long prompts
       (saving ~0) are balanced when the home's queue is twice ``t``'s, cached ones stay
       home while their queue is worth it. The coefficient of ``L_t`` is measured, not
       derived: 0 (until 2026-12-04) lost `bursts` 4-5 % of goodput in the simulator, an
       infinite one (only idle engines take spills) cost `long-tail` 9 points through
       the fleet, 2 trades the long-prompt families' TTFT p99 (up to 1.22x) for 1-2 %
       more on `bursts` (docs/history/2026-12-fleet-benchmark-default-policy.md,
       "The cost spill's price"). The spill also pays for the decodes its re-prefill
       stalls: with ``n_t`` the requests in flight at ``t`` (the view's in-flight count;
       read only when a request would leave its home) and ``w = stall_weight``, it goes
       iff ``L_home - L_t > saving + L_t + w · saving · n_t``. An engine prefills in chunks
       that share each step with its decodes, so the re-prefilled saving holds up every
       request decoding at ``t`` for that prefill, between two of its tokens. A queue
       count cannot see this: past the fleet's capacity on shared documents the engines
       are decode-bound with short prefill queues, and spills even onto engines with no
       queued prefill at all re-prefilled enough to push the decodes over the TBOT SLO
       (`rag` at 4x nominal: 11.3 req/s of goodput, `cache-aware` 26.2; 16.8 with this
       stall priced; docs/fleet-benchmark.md, "The re-prefill's stall"). A session id the
       client declared is never cost-spilled.
       **Engines of unequal speed.** Where the engines' configured capacities differ
       (``FleetView.prefill_cost``: ``r_e``, each engine's time per prefilled token
       relative to the fastest's, ``max(capacity_rps) / capacity_rps_e >= 1``), every term
       of the spill is prefill time: ``t`` is the eligible engine other than the home
       where the request would start soonest, the least ``(L_e + saving) · r_e`` (ties by
       the deepest key's hash), and the request goes iff
       ``L_home · r_home - L_t · r_t > (saving + L_t + w · saving · n_t) · r_t``. A token
       queued on an L4 waits several times as long as one on an H100: counted in tokens,
       a spill took a slow engine with a short queue over a fast one with a longer queue,
       and a slow home's queue weighed as little as a fast one's (simulator, 4 seeds,
       the eight families at 70 / 90 %: on 1 H100 + 1 A100 + 2 L4 goodput +1.5 % on the
       geometric mean, `prefix-tree` +3.3 to +6.9 %, `mooncake` +2.7 to +6.6 %, TTFT p99
       x0.58-0.99 outside `hot-prompt` (x1.01); on 2 H100 + 2 A40 +0.6 %; no cell lower;
       docs/fleet-benchmark.md, "The cost spill in prefill time"). Rules 2 and 3 stay in
       tokens: the bound compares shares of the queued work with the LP's weights, which
       are shares of work. No tunable: the capacities are the operator's (the simulator's
       are measured, and there within 10 % of the profiles' prefill-time ratios); with
       equal ones the rule is the token rule above, decision for decision. Counting the
       capacity ratio at its square root or its square (r^0.5, r^2) gives +1.5 / +2.6 %
       against +1.7 % on the three-GPU fleet at 1 x 1, every cell at or above tokens.

Why shallowest first
    The shallowest group is the largest set of requests sharing a prefix, so routing by
    it co-locates the most reuse; a group is split (by the next depth) only when its
    demand is more than one engine's share, and the load bound absorbs what the share
    estimate has not seen yet (bursts, a cold start). ``order = "deep"`` tries the
    deepest key first instead (most specific affinity, least co-location), for
    comparison.

What it keeps from rendezvous hashing
    Homes depend only on the prompt and the table (and the mask), so every worker process
    and every proxy agree on them without shared state (a per-worker record of what was
    sent where fragments). The tables it learns (shares, seen prefixes) record what was
    routed, and where only for rule 3 (the engine of the last request per key, which
    overrides a home only below the group's key, within the load bound); each worker
    feeds them the host's routed requests through the host's key log
    (:meth:`attach_key_log`, ``fastroute._core.keylog_py``), since a ``1/W`` sample
    lagged ``W`` times and missed the prefixes the other workers sent (4 workers:
    ``bursts`` −4.5 % of goodput in the simulator, none with the log); removing one of
    ``n`` engines moves the groups homed on it plus,
    through the trie, about ``1/n`` of the groups per trie level (measured: 1.8/n at
    100 engines, 2.5/n at 1,000, 3.6/n at 10,000; flat rendezvous 1/n); unrelated
    groups spread exactly as the LP's weights say. Up to 16 eligible engines the trie is
    one bucket and the ranking is flat rendezvous's, bit for bit.

Tunables
    ``block_bytes`` : int >= 64, bytes; default 512 (128 tokens at 4 bytes per token).
        The shallowest depth. Below about 128 tokens a cache hit saves less prefill than
        one engine's queue costs, and 128 tokens is vLLM's CPU KV-block size (GPU blocks
        are 16 tokens, so any depth >= 16 tokens can hit there). Simulator, the 32 family
        cells, 4 seeds: 256 / 1024 / 2048 move goodput by +0.5 / +0.3 / −0.6 % (geometric
        mean; the extreme cells −5.0 / +6.3 %, `long-tail` 0.9) and the prefix-hit rate
        by at most 0.1 point (docs/policies.md, "Sensitivity").
    ``prefix_bytes`` : int >= ``block_bytes``, bytes; default 32768 (about 8 k tokens).
        The deepest depth read. Depths double, so this is ``log2(prefix_bytes/block)+1``
        keys (7 by default) and about ``2 · prefix_bytes`` bytes hashed in the worst case.
        It also caps the saving rules 2-4 can see: a session cached deeper than this is
        valued at 8 k tokens. Simulator, as above: 16384 −0.4 % (`prefix-tree` 0.9 −3.1 %,
        TTFT p99 ×1.04), 65536 and 131072 +0.2 % (TTFT p99 ×0.99; `agentic` ×1.07 at
        most). Through the fleet, `agentic-90`, 131072: TTFT p99 1082 → 829 ms at seed 2
        (its two slowest were cost spills of 12-18 k cached tokens valued at 8 k), level
        at seeds 1 and 3, 746 → 821 ms at seed 4 (docs/fleet-benchmark.md, "The TTFT p99
        misses, request by request"); the simulator's `agentic`, 8 seeds, ×1.10 at 0.7,
        ×1.00 at 0.9. No gain to pay for hashing four times as much of a long prompt.
    ``balance_factor`` : float >= 1, dimensionless; default 2.0. ``c`` of rule 2: how far
        above its LP share of the queued prompt tokens an engine may go. Tighter bounds
        spill conversations away from their cache on ordinary fluctuations (1.25 cost 8
        points of prefix hits on multi-turn chat, measured on in-flight tokens); over the
        simulator's family matrix, c = 1.5, 2, 3 give goodput within 1 % of each other
        (geometric mean over 32 cells; docs/history/2026-12-fleet-benchmark-default-policy.md).
    ``hot_share_factor`` : float > 0, dimensionless; default 0.5. ``h`` of rule 1: a group
        keeps one engine only while it leaves at least half of that engine's share to the
        other groups that hash there (at ``h = 1`` a tenant with exactly one engine's share
        filled its home and the groups hashed beside it overloaded it: 35 % of chat-90's
        requests on one of 4 engines).
    ``hot_half_life_requests`` : float > 0, requests; default 1024. The memory of the
        share estimate. Estimating a share near the threshold ``1/n`` to ±25 % needs about
        ``16 n`` requests, so 1024 serves fleets up to about 64 engines; set it to ``16 n``
        for larger ones. Requests of the host with the key log, of the worker without it.
        It is also what keeps a busy session whole: an agent's steps come one after
        another, a large share of a short window and a small one of a long window, and
        at a shorter memory its keys turned hot and its steps were split off its cache
        (simulator, the 32 family cells, 4 seeds, 4 engines: 32 / 64 / 128 / 256 cost
        `agentic` 2.6–2.9 / 2.0–2.5 / 1.0–1.4 / 0–0.5 points of prefix hits and
        multiplied its TTFT p99 by 1.8–1.9 / 1.7–1.8 / 1.3–1.4 / 1.0–1.1 at equal
        goodput, every cell's goodput within −2.1 / +0.5 %; 16 engines, 2 seeds, 64 /
        256: 3.8–4.3 / 0.5–0.6 points, 1.3–1.4 / 1.1). A new prompt sent by many does
        not wait for it: its whole prompt has its own table (rule 1).
    ``affinity_slack`` : float >= 0, tokens of load per token saved; default 1.0. ``a``
        of rule 2: by how much of its saving the first home may exceed the bound. At 1 the
        bound yields exactly what staying saves, the exchange rate of rule 4 (a queued
        token delays the request as much as a prefilled one); 0 is the plain bound (a
        session with 25 k cached tokens spilled for a 15 k-token queue), large values leave
        cached homes to rule 4 alone. Fleet, one run each at 70 %: a = 0 → 1 halves the
        TTFT p99 (agentic 1760 → 831 ms, chat 380 → 215 ms) at equal goodput; simulator,
        4 seeds × 32 cells: a = 1 within 0.6 % of a = 0 in every family except bursts at
        0.7 (−1.8 %, p99 4.2 → 3.2 s), and a = 0.5 or 2 within 1.4 % of a = 1 in every
        cell (docs/history/2026-12-fleet-benchmark-default-policy.md).
    ``stall_weight`` : float >= 0, tokens of queue per token re-prefilled per request in
        flight at the target; default 0.1. ``w`` of rules 2 and 4: what one decode's stall weighs
        against the spilled request's own wait. A stall of ``D`` seconds spread over a
        decode of ``o`` tokens raises its mean TBOT by ``D / o``; a wait of ``D`` raises a
        TTFT by ``D``. Measured against their SLOs, one stall weighs
        ``SLO_ttft / (o · SLO_tbot)`` of a wait: 0.1 at 2 s / 0.1 s and ``o = 200`` (the
        families' mean output, lognormal with median 150). Longer outputs (reasoning) call
        for less, shorter ones (tool calls) for more. ``n_t`` is what the view counts: this
        host's attempts (``p`` proxies each see about ``1/p``, an effective ``w / p``).
        Simulator, 8 seeds × 32 nominal cells at 1 × 1 and 4 × 2 against ``w = 0``:
        goodput within −1.0 % / +2.2 % in every cell (geometric mean +0.15 % / +0.25 %),
        `bursts` +1.1 to +2.2 %; past saturation (2 seeds) `rag` 4x 11.3 → 20.3 req/s,
        `bursts` 2.5x 14.1 → 16.2, 4x 15.1 → 19.8. ``w`` = 0.03 / 0.3 / 1 give 17.9 / 19.4
        / 20.3 on `rag` 4x but cost `prefix-tree` 0.9 (4 seeds) 0.0 / −3.2 / −8.5 %
        (0.1: −1.2 % at 4 seeds, −1.0 % at 8), whose spills buy the TTFT it misses
        (docs/fleet-benchmark.md, "The re-prefill's stall"). On two real vLLM engines
        with 32-token outputs at 1 s / 0.1 s (the formula's 0.31), 0.3 moved fewer
        sessions off their cache and kept 1.1–2.1 points more prefix hits in every run
        pair; its goodput there was not resolved (docs/real-engines.md, "Routers on real
        engines").
    ``queued_floor_tokens`` : int >= 1, tokens; default 128. ``f`` of rule 2: the least
        prompt a queued attempt counts. What it stands for is the wait behind a queued
        request whose prompt is cached, on an engine whose slots are full: one running
        decode's end, about 350 tokens of prefill at the families' outputs on the A40
        profile (150 tokens at about 50 ms a step with 250 running: a decode ends every
        30 ms; 12 k prefill tokens a second), nothing on an engine with slots to spare,
        where a cached request is admitted at once.
        Simulator (`examples/scenarios/repeated-prompts.toml` at 3x, 2 seeds, without /
        with the LP's shed): 1 gives 60.1 / 48.3 req/s, 64 / 128 / 256 / 512 give 64.0 /
        50.2, 70.9 / 52.6, 75.1 / 53.5, 76.1 / 51.4 (round robin 76.1 / 51.0); the 16
        nominal cells are unchanged at 128 (within −1.4 / +1.1 % at 512); past saturation
        on shared documents (`rag`, `bursts` 2.5-4x, 8 seeds) 128 is within −1.2 / +2.1 %,
        512 costs `bursts` 2-3 % and `long-tail` 2.5x 6 %: counted higher, briefly
        queued cached turns put their homes over the bound. 128 is one block of the
        default ``block_bytes``, the least the policy counts as a cache hit.
    ``order`` : ``"shallow"`` (default) or ``"deep"``.

Invariants
    Every ranked engine is eligible; the chosen engine is within bound unless rounding
    empties the within-bound set; same history, loads and request give the same
    decision; with no history and ``L = 0`` the decision depends only on the prompt and
    the table.

Cost per request
    Hashing at most ``3 · prefix_bytes`` bytes (xxh3: the depths, and the whole key of
    every request but a declared session's, which reuses the deepest depth's hash when that
    depth is all of the bytes read), one share lookup and (on routing) two updates (shares,
    seen table) per depth key, one lookup and one update of the whole prompts' table, and
    no loop over the engines (a hot repeated prompt also walks its whole key's ranking to
    its turn, at most ``WALK_CAP`` positions): a
    descent of the rendezvous trie per ranked engine (about
    ``16 · ceil(log16(n / 16)) + 16`` hashes: 50 at 10,000 engines), one more descent
    per further candidate tried and per over-bound engine the bounded fallback walks
    past, one load chunk (256 engines) re-read and a memcmp of the n-byte eligibility
    mask against the cached tree's (the one O(n) step; a request that would leave its home
    also reads the view's in-flight counts, one O(n) copy in the proxy, and when the load
    bound sends it away ranks the candidates a second time; on engines of unequal speed,
    a request whose home's queue takes longer than its saving's prefill makes one pass
    over the engines for the spill's target; rule 3 looks up one engine id and sums the
    n/256 load chunks' totals), all in the compiled core
    (``fastroute/_core/prefix.pyx`` and ``selector.pyx``; their specs ``prefix_py.py``
    and ``selector_tree.py``). The trie is built once per table and eligibility mask
    (O(n log n): 0.02 ms at 100 engines, 0.2 ms at 1,000, 3 ms at 10,000), so a fleet whose
    mask changes often (``max_concurrency`` caps flipping) pays a build per change.
    ``bench/bench_prefix_pick.py`` times a decision.

``Decision.reason``: ``"prefix-home"`` (the first candidate's home), ``"prefix-spill"``
(a later candidate's home), ``"bounded-spill"`` (no home within bound), ``"prefix-follow"``
(rule 3: where the request's deepest seen prefix was last sent), ``"cost-spill"``
(rule 4) or ``"no-prefix"``
(prompt shorter than one block: the routing key's home, under the same bound).
``scores`` holds, for the chosen engine only, the depth in bytes of the key that decided
(-1 for the bounded fallback and the cost spill) and then 0 for the other ranked engines.
``cached_tokens`` is what rule 2's load leaves out of the attempt's prompt: the saving the
rules counted at the chosen engine (tokens; 0 for the bounded fallback and the cost spill),
at most the prompt less ``queued_floor_tokens``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from fastroute._core import KeyLog, PrefixPicker
from fastroute._core.keylog_py import init_key_log, key_log_size
from fastroute._core.prefix_py import (
    HOT_LEAVE_RATIO,
    MAX_CANDIDATES,
    MAX_DEPTH_KEYS,
    MIN_BLOCK_BYTES,
    depth_keys,
)
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

__all__ = [
    "HOT_LEAVE_RATIO",
    "MAX_CANDIDATES",
    "MIN_BLOCK_BYTES",
    "PrefixHRW",
    "depth_keys",
    "private_key_log",
]

_ORDERS = ("shallow", "deep")
#: Deepest ``prefix_bytes / block_bytes`` (exclusive): the compiled core keeps at most
#: :data:`~fastroute._core.prefix_py.MAX_DEPTH_KEYS` keys per request.
_MAX_DEPTH_RATIO = 1 << (MAX_DEPTH_KEYS - 2)


def private_key_log(entries: int) -> bytearray:
    """An empty key log of ``entries`` (a power of two >= 16) in this process's memory, for
    policy instances that share one process (the simulator's workers of one proxy); the
    proxy's workers share ``fastroute.tables.key_log.KeyLogSegment`` instead."""
    buffer = bytearray(key_log_size(entries))
    init_key_log(buffer, entries)
    return buffer


def _prefill_loads(view: FleetView) -> Any:
    """The loads the bound and the spill compare: queued prompt tokens where the view
    tracks them, else in-flight tokens, else in-flight requests."""
    loads = view.queued_tokens()
    if loads is None:
        loads = view.in_flight_tokens()
    if loads is None:
        loads = view.in_flight()
    return loads


class PrefixHRW(Policy):
    """Rendezvous homes of the prompt's prefix depths, hot groups spread, load bounded.

    Parameters
    ----------
    block_bytes : int
        Shallowest prefix depth in bytes, ``>= 64``; default 512.
    prefix_bytes : int
        Deepest prefix depth read, bytes, ``>= block_bytes``; default 32768.
    balance_factor : float
        ``c >= 1``: bound on an engine's share of the queued prompt tokens over its LP share;
        default 2.0.
    hot_share_factor : float
        ``h > 0``: a group whose share of the recent requests exceeds ``h / n`` is hot;
        default 0.5.
    hot_half_life_requests : float
        Half-life of the group-share estimate, requests, ``> 0``; default 1024.
    affinity_slack : float
        ``a >= 0``: the first candidate's home keeps the request while its queued prompt
        tokens exceed the bound by at most ``a`` times the request's saving there;
        default 1.0.
    stall_weight : float
        ``w >= 0``: leaving the home (the load bound or the cost spill) also pays ``w``
        times the saving per request in flight where the request would go (the decodes
        its re-prefill stalls); default 0.1.
    queued_floor_tokens : int
        ``f >= 1``: the least prompt a queued attempt counts in the load, tokens (the
        whole prompt if shorter); default 128.
    order : {"shallow", "deep"}
        Which depth key is tried first; default ``"shallow"``.
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
        affinity_slack: float = 1.0,
        stall_weight: float = 0.1,
        queued_floor_tokens: int = 128,
        order: str = "shallow",
    ) -> None:
        if not isinstance(block_bytes, int) or block_bytes < MIN_BLOCK_BYTES:
            raise PolicyConfigError(
                f"prefix-hrw: block_bytes must be an integer >= {MIN_BLOCK_BYTES}, "
                f"got {block_bytes!r}"
            )
        if (
            not isinstance(prefix_bytes, int)
            or prefix_bytes < block_bytes
            or prefix_bytes // block_bytes >= _MAX_DEPTH_RATIO
        ):
            raise PolicyConfigError(
                f"prefix-hrw: prefix_bytes must be an integer >= block_bytes "
                f"({block_bytes}) and < block_bytes * 2**{MAX_DEPTH_KEYS - 2}, "
                f"got {prefix_bytes!r}"
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
        if not affinity_slack >= 0:
            raise PolicyConfigError(
                f"prefix-hrw: affinity_slack must be >= 0, got {affinity_slack!r}"
            )
        if not stall_weight >= 0:
            raise PolicyConfigError(f"prefix-hrw: stall_weight must be >= 0, got {stall_weight!r}")
        if not isinstance(queued_floor_tokens, int) or queued_floor_tokens < 1:
            raise PolicyConfigError(
                f"prefix-hrw: queued_floor_tokens must be an integer >= 1, "
                f"got {queued_floor_tokens!r}"
            )
        if order not in _ORDERS:
            raise PolicyConfigError(f"prefix-hrw: order must be one of {_ORDERS}, got {order!r}")
        self.block_bytes = block_bytes
        self.prefix_bytes = prefix_bytes
        self.balance_factor = float(balance_factor)
        self.hot_share_factor = float(hot_share_factor)
        self.hot_half_life_requests = float(hot_half_life_requests)
        self.affinity_slack = float(affinity_slack)
        self.stall_weight = float(stall_weight)
        self.queued_floor_tokens = queued_floor_tokens
        self.order = order
        self._picker = PrefixPicker(
            block_bytes,
            prefix_bytes,
            self.balance_factor,
            self.hot_share_factor,
            self.hot_half_life_requests,
            deep=order == "deep",
            bytes_per_token=float(BYTES_PER_TOKEN),
            affinity_slack=self.affinity_slack,
            stall_weight=self.stall_weight,
        )

    @property
    def hot(self) -> object:
        """The share estimate (``fastroute._core.HotKeys``)."""
        return self._picker.hot

    @property
    def seen(self) -> object:
        """The seen table: every depth of every routed request (the cost spill's saving)."""
        return self._picker.seen

    def keys(self, request: RouteRequest) -> list[tuple[int, int]]:
        """The request's ``(depth_bytes, key)`` pairs, shallow first (see the module)."""
        return self._picker.keys(
            request.prefix, request.key_hash, request.key_depth_bytes, request.prompt_tokens
        )

    def choose(self, request: RouteRequest, view: FleetView, k: int = DEFAULT_K) -> Decision:
        check_k(k)
        loads = _prefill_loads(view)
        ranked, reason, depth, cached = self._picker.choose(
            view.selector,
            request,
            view.eligible(request.row),
            loads,
            k,
            view.in_flight,
            view.prefill_cost(),
        )
        if not ranked:
            return self._empty()
        # Built here rather than by _decision: the picker's values are ints and floats.
        ids = self._engine_ids(view)
        scores = (float(depth),) + (0.0,) * (len(ranked) - 1)
        # Rule 2's floor: a queued attempt counts at least f of its prompt.
        cached = min(cached, max(0, request.prompt_tokens - self.queued_floor_tokens))
        return Decision(
            tuple(ranked), tuple([ids[i] for i in ranked]), self.name, reason, scores, cached
        )

    def on_routed(self, request: RouteRequest, engine_id: int) -> None:
        self._picker.on_routed(request, engine_id)

    def attach_key_log(
        self, buffer: Any, writer_id: int, channel: int, lock_fd: int | None = None
    ) -> Any:
        """Count the host's other workers' routed requests in the share and seen tables
        too (rule 1's shares and rule 4's saving are the host's, not this worker's), and
        publish this worker's; see ``fastroute._core.keylog_py``."""
        log = KeyLog(buffer, writer_id, channel, lock_fd)
        self._picker.attach_log(log)
        return log

    def reset(self) -> None:
        self._picker.reset()

    def __repr__(self) -> str:
        return (
            f"<PrefixHRW block_bytes={self.block_bytes} prefix_bytes={self.prefix_bytes} "
            f"balance_factor={self.balance_factor} hot_share_factor={self.hot_share_factor} "
            f"hot_half_life_requests={self.hot_half_life_requests} "
            f"affinity_slack={self.affinity_slack} stall_weight={self.stall_weight} "
            f"queued_floor_tokens={self.queued_floor_tokens} "
            f"order={self.order!r}>"
        )
