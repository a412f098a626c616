"""Engine performance model, driven in virtual time: scheduling, KV, timing, P/D."""

from __future__ import annotations

import random
import statistics

import pytest

from fastroute.emulator.model import (
    EngineConfig,
    EngineModel,
    OutputLengthDistribution,
    Phase,
    QueueFullError,
    Request,
    RequestTooLongError,
    replay,
)
from fastroute.hardware import PROFILES
from fastroute.tokens import tokenize_text

A40 = PROFILES["a40"]
H100 = PROFILES["h100"]


def _req(rid: str, prompt: int, out: int, hashes=(), **kw) -> Request:
    return Request(rid, prompt, hashes, output_tokens=out, **kw)


def _ttft(r: Request) -> float:
    return r.first_token_s - r.arrival_s


def _tbot(r: Request) -> float:
    return (r.last_token_s - r.first_token_s) / (r.num_output - 1)


def test_single_request_step_times_follow_the_formula():
    """Prefill step = a0+a1n+a2n²; each decode step = b0+b1+b2·context."""
    m = EngineModel(A40)
    m.submit(_req("r", 500, 3), 0.0)
    s1 = m.step(0.0)
    assert s1.num_prefill_tokens == 500 and s1.emitted[0].request_id == "r"
    assert s1.duration_s == pytest.approx(A40.a0_s + A40.a1_s * 500 + A40.a2_s * 500**2)
    s2 = m.step(s1.end_s)
    assert s2.num_decode_seqs == 1 and s2.num_decode_context_tokens == 501
    assert s2.duration_s == pytest.approx(A40.b0_s + A40.b1_s + A40.b2_s * 501)
    s3 = m.step(s2.end_s)
    assert s3.finished and s3.finished[0].finish_reason == "length"
    assert m.next_step_time(s3.end_s) is None and m.kv.num_used == 0


def test_mixed_step_is_decode_part_plus_prefill_chunk():
    """A step with decodes and a prefill chunk costs T_dec(B,S) + a1n + a2n² + a3nc."""
    m = EngineModel(A40)
    m.submit(_req("a", 100, 10), 0.0)
    t = m.step(0.0).end_s
    m.submit(_req("b", 300, 10), t)
    s = m.step(t)
    assert (s.num_decode_seqs, s.num_prefill_tokens) == (1, 300)
    expected = (A40.b0_s + A40.b1_s + A40.b2_s * 101) + A40.a1_s * 300 + A40.a2_s * 300**2
    assert s.duration_s == pytest.approx(expected)


def test_chunked_prefill_respects_the_token_budget():
    """A 5000-token prompt with a 2048 budget takes three steps before its first token."""
    m = EngineModel(A40)
    assert m.max_num_batched_tokens == 2048
    m.submit(_req("long", 5000, 2), 0.0)
    t, chunks = 0.0, []
    while True:
        s = m.step(t)
        chunks.append(s.num_prefill_tokens)
        t = s.end_s
        if s.emitted:
            break
    assert chunks == [2048, 2048, 904]
    # The later chunks attend to the earlier ones: the a3·n·c term is charged.
    m2 = EngineModel(A40)
    m2.submit(_req("x", 5000, 2), 0.0)
    s1 = m2.step(0.0)
    s2 = m2.step(s1.end_s)
    assert s2.duration_s == pytest.approx(
        A40.a0_s + A40.a1_s * 2048 + A40.a2_s * 2048**2 + A40.a3_s * 2048 * 2048
    )


def test_ttft_grows_with_queue_depth():
    """The k-th of a burst of identical requests waits for the prefills before it."""
    m = EngineModel(A40)
    reqs = replay(m, [(0.0, _req(f"r{i}", 1500, 20)) for i in range(12)])
    ttfts = [_ttft(r) for r in reqs]
    assert ttfts == sorted(ttfts)
    assert ttfts[-1] > 5 * ttfts[0]


def test_replay_schedules_follow_ups_and_reports_refusals():
    """on_finished's arrivals join the replay (a closed-loop next turn); a request the full
    queue refuses goes to on_refused, and every arrival is returned in arrival order."""
    m = EngineModel(A40, EngineConfig(max_num_seqs=1, max_waiting=1))
    refused: list[str] = []

    def next_turn(req: Request) -> list[tuple[float, Request]]:
        if req.request_id == "a":
            assert req.finish_s is not None
            return [(req.finish_s + 0.5, _req("a2", 100, 2))]
        return []

    arrivals = [(0.0, _req(rid, 100, 2)) for rid in ("a", "b", "c")]
    out = replay(
        m, arrivals, on_finished=next_turn, on_refused=lambda r: refused.append(r.request_id)
    )
    assert [r.request_id for r in out] == ["a", "b", "c", "a2"]
    assert refused == ["b", "c"]  # all arrive before a step: "a" fills the one-place queue
    a, a2 = out[0], out[3]
    assert a2.arrival_s == pytest.approx(a.finish_s + 0.5) and a2.finish_s is not None
    with pytest.raises(QueueFullError):
        replay(EngineModel(A40, EngineConfig(max_num_seqs=1, max_waiting=1)), arrivals)


def test_ttft_grows_with_prompt_length():
    """Longer prompts take longer to prefill (n and n² terms)."""
    ttfts = []
    for n in (100, 1000, 4000, 7000):
        (r,) = replay(EngineModel(A40), [(0.0, _req("r", n, 2))])
        ttfts.append(_ttft(r))
    assert ttfts == sorted(ttfts) and ttfts[-1] > 10 * ttfts[0]


def test_tbot_grows_with_batch_size():
    """More concurrent decodes make every decode step slower (b1·B + b2·S)."""
    tbots = []
    for batch in (1, 8, 64):
        reqs = replay(EngineModel(A40), [(0.0, _req(f"r{i}", 200, 100)) for i in range(batch)])
        tbots.append(statistics.median(_tbot(r) for r in reqs))
    assert tbots[0] < tbots[1] < tbots[2]


def test_tbot_grows_with_context():
    """The same batch decodes slower over longer contexts (b2·S)."""
    short = replay(EngineModel(A40), [(0.0, _req(f"s{i}", 200, 50)) for i in range(8)])
    long_ = replay(EngineModel(A40), [(0.0, _req(f"l{i}", 6000, 50)) for i in range(8)])
    assert statistics.median(map(_tbot, long_)) > 1.2 * statistics.median(map(_tbot, short))


def test_repeated_prefix_is_served_from_cache():
    """The second request with the same long prefix hits the cache: lower TTFT, cached tokens."""
    system = "You are a careful assistant. " * 200  # ~5800 bytes
    a = tokenize_text(system + "Question one?")
    b = tokenize_text(system + "Question two, a little longer?")
    m = EngineModel(A40)
    (ra,) = replay(m, [(0.0, _req("a", a.num_tokens, 5, a.block_hashes))])
    (rb,) = replay(m, [(10.0, _req("b", b.num_tokens, 5, b.block_hashes))])
    assert ra.num_cached_tokens == 0
    assert rb.num_cached_tokens >= 16 * 90 and rb.num_cached_tokens % 16 == 0
    assert _ttft(rb) < 0.3 * _ttft(ra)
    assert m.prefix_cache_queries_total == a.num_tokens + b.num_tokens
    assert m.prefix_cache_hits_total == rb.num_cached_tokens


def test_fully_cached_prompt_still_computes_one_token():
    """An identical prompt hits at most prompt-1 tokens (whole blocks), like vLLM."""
    p = tokenize_text("x" * 64 * 10)  # exactly 10 blocks
    m = EngineModel(A40)
    replay(m, [(0.0, _req("a", p.num_tokens, 2, p.block_hashes))])
    (r,) = replay(m, [(5.0, _req("b", p.num_tokens, 2, p.block_hashes))])
    assert r.num_cached_tokens == 9 * 16


def test_prefix_caching_can_be_disabled():
    """With enable_prefix_caching=False nothing is cached or counted."""
    p = tokenize_text("y" * 3000)
    m = EngineModel(A40, EngineConfig(enable_prefix_caching=False))
    replay(m, [(0.0, _req("a", p.num_tokens, 2, p.block_hashes))])
    (r,) = replay(m, [(5.0, _req("b", p.num_tokens, 2, p.block_hashes))])
    assert r.num_cached_tokens == 0 and m.prefix_cache_queries_total == 0


def test_kv_exhaustion_queues_and_preempts_without_losing_requests():
    """A cache too small for the batch preempts (recompute), and every request still finishes."""
    m = EngineModel(A40, EngineConfig(num_blocks=120))
    reqs = replay(m, [(0.0, _req(f"r{i}", 300, 400)) for i in range(10)])
    assert all(r.phase is Phase.FINISHED and r.num_output == 400 for r in reqs)
    assert m.num_preemptions_total > 0
    assert sum(r.num_preemptions for r in reqs) == m.num_preemptions_total
    assert m.kv.num_used == 0 and m.kv.num_free == 120
    assert m.generation_tokens_total == 10 * 400
    assert m.prompt_tokens_total == 10 * 300


def test_kv_pressure_limits_the_batch_and_queues_the_rest():
    """With room for 2 requests' KV, at most 2 run and the rest wait."""
    m = EngineModel(A40, EngineConfig(num_blocks=40))  # 640 tokens
    for i in range(6):
        m.submit(_req(f"r{i}", 300, 5), 0.0)
    m.step(0.0)
    assert m.num_running == 2 and m.num_waiting == 4
    assert m.kv_usage == pytest.approx(38 / 40)


def test_max_num_seqs_bounds_the_batch():
    """No more than max_num_seqs requests run at once."""
    m = EngineModel(H100, EngineConfig(max_num_seqs=4))
    for i in range(10):
        m.submit(_req(f"r{i}", 20, 50), 0.0)
    s = m.step(0.0)
    assert m.num_running == 4 and len(s.emitted) == 4 and m.num_waiting == 6


def test_cancel_shrinks_the_batch_and_frees_kv():
    """Cancelling a running request removes it from the batch and releases its blocks."""
    m = EngineModel(A40)
    for i in range(3):
        m.submit(_req(f"r{i}", 100, 50), 0.0)
    t = m.step(0.0).end_s
    used = m.kv.num_used
    assert m.cancel("r1") and not m.cancel("r1") and not m.cancel("nope")
    assert m.num_running == 2 and m.kv.num_used < used
    assert m.step(t).num_decode_seqs == 2
    m.submit(_req("w", 100, 5), t)
    assert m.cancel("w") and m.num_waiting == 0
    assert m.finished_total["abort"] == 2


def test_same_seed_same_schedule():
    """Two models with the same seed and inputs produce identical timings and lengths."""

    def run(seed: int) -> list[tuple[float, float, int]]:
        m = EngineModel(A40, seed=seed)
        rng = random.Random(1)
        arrivals = []
        for i in range(30):
            out = m.sample_output_tokens(500)
            arrivals.append((rng.uniform(0, 2), _req(f"r{i}", rng.randint(10, 3000), out)))
        return [(r.first_token_s, r.finish_s, r.num_output) for r in replay(m, arrivals)]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_output_length_distribution_is_lognormal_and_capped():
    """Median ≈ e^mu; draws are ≥ 1 and respect the cap."""
    rng = random.Random(0)
    dist = OutputLengthDistribution()
    draws = [dist.sample(rng) for _ in range(4000)]
    assert min(draws) >= 1
    assert 170 < statistics.median(draws) < 230  # e^5.3 ≈ 200
    m = EngineModel(A40, seed=0)
    assert max(m.sample_output_tokens(50) for _ in range(200)) == 50


def test_slowdown_multiplies_step_time():
    """A slowdown of 3 makes the same step exactly three times longer."""
    m1, m3 = EngineModel(A40), EngineModel(A40)
    m3.slowdown = 3.0
    for m in (m1, m3):
        m.submit(_req("r", 800, 2), 0.0)
    assert m3.step(0.0).duration_s == pytest.approx(3 * m1.step(0.0).duration_s)


def test_bounded_waiting_queue_and_impossible_requests():
    """A full waiting queue raises QueueFullError; over-long requests are refused up front."""
    m = EngineModel(A40, EngineConfig(max_waiting=2, num_blocks=64))
    m.submit(_req("a", 10, 5), 0.0)
    m.submit(_req("b", 10, 5), 0.0)
    with pytest.raises(QueueFullError):
        m.submit(_req("c", 10, 5), 0.0)
    with pytest.raises(RequestTooLongError, match="maximum context length"):
        EngineModel(A40).submit(_req("d", 8000, 500), 0.0)
    with pytest.raises(RequestTooLongError, match="KV blocks"):
        m.check(1000, 100)  # 69 blocks > 64
    fresh = EngineModel(A40)
    fresh.submit(_req("a", 10, 5), 0.0)
    with pytest.raises(ValueError, match="already"):
        fresh.submit(_req("a", 10, 5), 0.0)  # duplicate live id
    first = fresh.step(0.0)
    with pytest.raises(ValueError, match="before the previous step ends"):
        fresh.step(first.end_s / 2)


def test_prefill_side_holds_kv_until_claimed():
    """hold_kv keeps a finished request's blocks until the decode side claims them."""
    m = EngineModel(A40)
    (r,) = replay(m, [(0.0, _req("p", 1000, 1, hold_kv=True))])
    assert r.phase is Phase.HELD and m.num_held == 1
    assert m.kv.num_used == r.num_blocks_held == 63
    assert m.claim_transfer("p", r.finish_s + 1).num_prompt_tokens == 1000
    assert m.kv.num_used == 0
    with pytest.raises(KeyError):
        m.claim_transfer("p", r.finish_s + 2)


def test_claimed_transfers_do_not_accumulate():
    """Bookkeeping of held KV stays proportional to what is still held."""
    m = EngineModel(H100)
    for i in range(500):
        (r,) = replay(m, [(i * 1.0, _req(f"p{i}", 40, 1, hold_kv=True))])
        m.claim_transfer(f"p{i}", r.finish_s)
    assert m.num_held == 0 and len(m._held_expiry) <= 64 and m.kv.num_used == 0


def test_held_kv_expires_after_the_timeout():
    """Unclaimed KV is released after kv_transfer_timeout_s (vLLM's NIXL abort timeout)."""
    m = EngineModel(A40, EngineConfig(kv_transfer_timeout_s=5.0))
    (r,) = replay(m, [(0.0, _req("p", 500, 1, hold_kv=True))])
    assert m.held("p", r.finish_s + 4.9) is not None
    assert m.held("p", r.finish_s + 5.1) is None and m.kv.num_used == 0
    with pytest.raises(KeyError):
        m.claim_transfer("p", r.finish_s + 6)


def test_decode_side_charges_transfer_not_prefill():
    """A remote-prefill request waits bytes/bandwidth + latency, then computes one token."""
    cfg = EngineConfig(kv_transfer_bandwidth_Bps=10e9, kv_transfer_latency_s=2e-3)
    m = EngineModel(A40, cfg)
    (r,) = replay(m, [(0.0, _req("d", 4001, 3, remote_prefill=True))])
    transfer = 2e-3 + 4000 * A40.kv_bytes_per_token / 10e9
    one_token = A40.a0_s + A40.a1_s + A40.a2_s + A40.a3_s * 4000
    assert _ttft(r) == pytest.approx(transfer + one_token)
    assert r.num_transferred_tokens == 4000 and r.num_cached_tokens == 4000
    (full,) = replay(EngineModel(A40), [(0.0, _req("f", 4001, 3))])
    assert _ttft(r) < 0.5 * _ttft(full)


def test_loading_requests_count_as_waiting():
    """While its KV arrives a decode-side request is reported as waiting, not running."""
    m = EngineModel(A40)
    m.submit(_req("d", 2001, 3, remote_prefill=True), 0.0)
    s = m.step(0.0)
    assert s.idle and m.num_waiting == 1 and m.num_running == 0
    ready = m.next_step_time(0.0)
    assert ready == pytest.approx(m.transfer_time_s(2000))
    m.step(ready)
    assert m.num_running == 1 and m.num_waiting == 0


def test_counters_match_served_tokens(rand):
    """generation/prompt token counters equal the sums over finished requests."""
    m = EngineModel(H100, seed=3)
    arrivals = [
        (rand.uniform(0, 1), _req(f"r{i}", rand.randint(1, 2000), rand.randint(1, 300)))
        for i in range(50)
    ]
    reqs = replay(m, arrivals)
    assert m.generation_tokens_total == sum(r.output_tokens for r in reqs)
    assert m.prompt_tokens_total == sum(r.num_prompt_tokens for r in reqs)
    assert m.finished_total["length"] == 50
    assert m.num_running == m.num_waiting == 0 and m.kv.num_used == 0
