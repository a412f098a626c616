"""EngineLoad: the marginal-cost policy's engine state from the proxy's bookkeeping and
scrapes, and the calibration fed from tracked attempts."""

from __future__ import annotations

import time

import numpy as np
import pytest

from fastroute.config import decode_config
from fastroute.policy.marginal import EngineStateView, MarginalCost, MarginalRequest, StateColumn
from fastroute.proxy.background.scraper import EngineScraper
from fastroute.proxy.path.engine_load import (
    FLUSH_TOKENS,
    MAX_SCRAPE_AGE_S,
    MIN_SAMPLES_TO_REJECT,
    AttemptLoad,
    EngineLoad,
    parse_usage,
)
from fastroute.proxy.path.fleet import Fleet
from fastroute.proxy.path.sse import StreamMeter
from fastroute.signals.vllm import EngineSignals

_CONFIG = "".join(
    f'[[engines]]\nname = "e{i}"\nurl = "http://127.0.0.1:{9000 + i}"\nmodels = ["m"]\n'
    f'hardware = "{hw}"\ncapacity_rps = 10.0\n\n'
    for i, hw in enumerate(["h100", "h100", "a40"])
)
ROUTE = MarginalRequest(key_hash=1, row=0, prompt_tokens=100, prefix=b"hello")


def _load() -> tuple[Fleet, MarginalCost, EngineLoad]:
    fleet = Fleet(decode_config(_CONFIG))
    policy = MarginalCost(seed=1)
    load = fleet.load = EngineLoad(fleet.engines, policy)
    return fleet, policy, load


def _stream_chunk(token: str, role: bool = False) -> bytes:
    out = b""
    if role:
        out += b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
    return out + b'data: {"choices":[{"delta":{"content":"%s"}}]}\n\n' % token.encode()


def _relay(a: AttemptLoad, data: bytes, now_s: float) -> None:
    """What the relay tells a tracked attempt of one read (its meter is per attempt)."""
    meter = _METERS.setdefault(id(a), StreamMeter())
    before = meter.token_events
    meter.feed(data, now_s)
    if meter.token_events != before:
        a.tokens(meter.token_events - before, now_s)
    a.usage = meter.usage


_METERS: dict[int, StreamMeter] = {}

USAGE = (
    b'data: {"choices":[],"usage":{"prompt_tokens":120,"completion_tokens":3,'
    b'"prompt_tokens_details":{"cached_tokens":32}}}\n\ndata: [DONE]\n\n'
)


def test_types_capacity_and_view_protocol() -> None:
    fleet, _, load = _load()
    state = load.state
    assert state.type_names == ("a40", "h100")
    assert state.column("engine_type").tolist() == [1.0, 1.0, 0.0]
    cap = state.column("kv_capacity_tokens")
    assert cap[0] == cap[1] > cap[2] > 0  # the profiles' nominal capacities
    assert np.isnan(state.column("running_remaining_tokens")).all()
    view = fleet.load_view(fleet.eligibility.request_mask(frozenset({""}), None))
    assert isinstance(view, EngineStateView)
    assert view.engine_state() is state and view.cached_prefix_tokens(ROUTE) is None
    assert not isinstance(
        fleet.view(fleet.eligibility.request_mask(frozenset({""}), None)), EngineStateView
    )


def test_an_attempt_is_queued_then_running_then_gone() -> None:
    _, _, load = _load()
    v = load.state.values
    a = load.admit(1, ROUTE, 10.0)
    assert v[1, StateColumn.QUEUED_PREFILL_TOKENS] == 100 and v[1, StateColumn.QUEUED_REQUESTS] == 1
    assert v[1, StateColumn.KV_USED_TOKENS] == 100 and v[0].tolist()[:4] == [0, 0, 0, 0]
    a.first_token(10.05)
    assert v[1, StateColumn.QUEUED_REQUESTS] == 0 and v[1, StateColumn.RUNNING_SEQS] == 1
    assert v[1, StateColumn.RUNNING_CONTEXT_TOKENS] == 100
    _relay(a, _stream_chunk("a", role=True), 10.05)
    _relay(a, _stream_chunk("b") + _stream_chunk("c"), 10.07)
    assert a.events == 3  # the role event is not a token
    assert v[1, StateColumn.RUNNING_CONTEXT_TOKENS] == 100  # added FLUSH_TOKENS at a time
    _relay(a, b"".join(_stream_chunk("t") for _ in range(FLUSH_TOKENS - 3)), 10.08)
    assert a.events == FLUSH_TOKENS
    assert v[1, StateColumn.RUNNING_CONTEXT_TOKENS] == 100 + FLUSH_TOKENS
    assert v[1, StateColumn.KV_USED_TOKENS] == 100 + FLUSH_TOKENS
    _relay(a, _stream_chunk("u"), 10.09)
    _relay(a, USAGE, 10.10)
    assert a.events == FLUSH_TOKENS + 1 and a.last_s == 10.09  # usage, [DONE]: no tokens
    load.release(a, False, 10.08)
    load.release(a, False, 10.08)  # idempotent
    assert not v[:, :4].any() and not v[:, StateColumn.KV_USED_TOKENS].any()
    assert load.observed == 0  # a failed attempt does not calibrate


def test_a_stream_calibrates_prefill_decode_and_output_length() -> None:
    _, policy, load = _load()
    model = policy.calibration.model("h100")
    busy = load.admit(0, ROUTE, 9.0)
    busy.first_token(9.1)  # a request already running on engine 0
    a = load.admit(0, ROUTE, 10.0)
    assert (a.batch0, a.context0, a.queued0) == (1.0, 100.0, 0.0)
    a.first_token(10.03)
    _relay(a, _stream_chunk("a", role=True), 10.03)
    _relay(a, _stream_chunk("b"), 10.04)
    _relay(a, _stream_chunk("c"), 10.05)
    _relay(a, USAGE, 10.05)
    assert a.usage is not None and a.usage.prompt_tokens == 120
    before = policy.output_lengths.mean()
    load.release(a, True, 10.06)
    assert model.samples_by_kind == {"prefill": 1, "decode": 1}
    assert load.observed == 2
    assert policy.output_lengths.mean() != before
    # The decode step of a P/D request: TTFT is KV transfer, only TBOT calibrates.
    d = load.admit(1, ROUTE, 11.0, decode_stage=True)
    d.first_token(11.01)
    _relay(d, _stream_chunk("x") + _stream_chunk("y"), 11.01)
    _relay(d, _stream_chunk("z"), 11.02)
    load.release(d, True, 11.03)
    assert model.samples_by_kind == {"prefill": 1, "decode": 2}


def test_a_one_token_json_answer_is_a_prefill_step() -> None:
    _, policy, load = _load()
    a = load.admit(2, ROUTE, 5.0)
    a.body(b'{"choices":[{"text":"x"}],"usage":{"prompt_tokens":90,"completion_tokens":1}}')
    load.release(a, True, 5.2)
    assert policy.calibration.model("a40").samples_by_kind == {"prefill": 1, "decode": 0}
    # A longer JSON answer: only its output length is learned (no TTFT in it).
    b = load.admit(2, ROUTE, 6.0)
    b.body(b'{"choices":[],"usage":{"prompt_tokens":90,"completion_tokens":40}}')
    load.release(b, True, 6.5)
    assert policy.calibration.model("a40").samples_by_kind == {"prefill": 1, "decode": 0}
    assert not load.state.values[:, :4].any()


def test_calibrated_once_every_type_has_enough_samples_of_each_kind() -> None:
    _, policy, load = _load()
    cal = policy.calibration
    assert not load.calibrated()
    for _ in range(MIN_SAMPLES_TO_REJECT):
        cal.observe_prefill("h100", 1, 100, 0, 0.01)
        cal.observe_decode("h100", 1, 2, 300, 0.007)
    assert not load.calibrated()  # the a40 engine's type has none yet
    for _ in range(MIN_SAMPLES_TO_REJECT):
        cal.observe_prefill("a40", 3, 100, 0, 0.03)
    assert load.calibrated(("prefill",)) and not load.calibrated()
    # Calibration off: the nominal constants are the operator's choice, rejects allowed.
    fleet = Fleet(decode_config(_CONFIG))
    assert EngineLoad(fleet.engines, MarginalCost(calibrate=False)).calibrated()


def test_parse_usage() -> None:
    u = parse_usage(b'{"usage":{"prompt_tokens":5,"prompt_tokens_details":{"cached_tokens":2}}}')
    assert u is not None and u.prompt_tokens == 5 and u.prompt_tokens_details.cached_tokens == 2
    assert parse_usage(b'{"id":"x"}') is None
    assert parse_usage(b"not json") is None
    assert parse_usage(b'{"usage":"odd"}') is None


def test_fresh_scrapes_add_what_other_workers_run() -> None:
    fleet, _, load = _load()
    scraper = EngineScraper(fleet.engines)
    load.scraper = scraper
    v = load.state.values
    a = load.admit(0, ROUTE, 1.0)
    a.first_token(1.1)  # this worker: one running request of 100 tokens on e0
    now = time.time()
    scraper.results["e0"].signals = EngineSignals(
        num_requests_running=3, num_requests_waiting=2, kv_cache_usage=0.5, scraped_at_s=now
    )
    scraper.results["e1"].signals = EngineSignals(
        num_requests_running=5, scraped_at_s=now - MAX_SCRAPE_AGE_S - 1
    )  # stale: ignored
    scraper.rounds_total = 1
    state = load.engine_state()
    assert v[0, StateColumn.RUNNING_SEQS] == 3  # 1 own + 2 others
    assert v[0, StateColumn.QUEUED_REQUESTS] == 2
    assert v[0, StateColumn.RUNNING_CONTEXT_TOKENS] == 300  # others at the own mean context
    cap = v[0, StateColumn.KV_CAPACITY_TOKENS]
    assert v[0, StateColumn.KV_USED_TOKENS] == pytest.approx(0.5 * cap)
    assert v[1, :4].tolist() == [0, 0, 0, 0]
    assert state is load.state
    # The own request ends: the offset stays until the next round, then is recomputed.
    load.release(a, True, 1.2)
    assert v[0, StateColumn.RUNNING_SEQS] == 2
    scraper.results["e0"].signals = EngineSignals(num_requests_running=0, scraped_at_s=now)
    scraper.rounds_total = 2
    load.engine_state()
    assert not v[:, :4].any() and v[0, StateColumn.KV_USED_TOKENS] == 0


def test_scraped_prefix_hit_rate_fills_the_state_nan_when_unknown() -> None:
    """Each engine's windowed hit rate from its scrapes (engine-reported token counters);
    an engine without prefix-cache metrics, an idle one or a stale one is NaN, never 0."""
    fleet, _, load = _load()
    scraper = EngineScraper(fleet.engines)
    load.scraper = scraper
    hit_rate = load.state.prefix_hit_rate
    assert np.isnan(hit_rate).all()  # nothing scraped yet
    now = time.time()
    e0, e1 = scraper.results["e0"], scraper.results["e1"]
    for at, (queries, hits) in ((now - 2.0, (100.0, 0.0)), (now, (612.0, 384.0))):
        e0.absorb({"": EngineSignals(
            prefix_cache_queries_total=queries, prefix_cache_hits_total=hits, scraped_at_s=at
        )})  # fmt: skip
    e1.absorb({"": EngineSignals(num_requests_running=1, scraped_at_s=now)})  # no counters
    scraper.rounds_total = 1
    state = load.engine_state()
    assert state.prefix_hit_rate[0] == pytest.approx(384 / 512)
    assert np.isnan(state.prefix_hit_rate[1:]).all()
    e0.absorb({"": EngineSignals(
        prefix_cache_queries_total=612.0, prefix_cache_hits_total=384.0,
        scraped_at_s=now - MAX_SCRAPE_AGE_S - 1,
    )})  # fmt: skip
    scraper.rounds_total = 2
    assert np.isnan(load.engine_state().prefix_hit_rate[0])  # stale: unknown again


def test_prompts_prefilled_during_a_decode_are_its_mixed_step_feature() -> None:
    """The TBOT of a stream is observed with the prompt tokens whose prefill finished on
    its engine (their first chunk) between its first and last chunk, per decode step; the
    engine's expectation of it goes to the state's prefill_tokens_per_step column."""
    _, policy, load = _load()
    seen = []
    cal = policy.calibration
    observe = cal.observe_decode
    cal.observe_decode = lambda *a, **kw: seen.append(kw) or observe(*a, **kw)  # type: ignore[method-assign]
    queued = load.admit(0, ROUTE, 9.99)  # sent before a's first token, prefilled during it
    a = load.admit(0, ROUTE, 10.0)
    a.first_token(10.03)
    _relay(a, _stream_chunk("a", role=True), 10.03)
    queued.first_token(10.035)  # 100 prompt tokens prefilled beside a's decode
    other = load.admit(0, ROUTE, 10.035)  # sent during it, prefilled after: not counted
    elsewhere = load.admit(1, ROUTE, 10.035)
    elsewhere.first_token(10.036)  # another engine: not beside it
    pd = load.admit(0, ROUTE, 10.036, decode_stage=True)
    pd.first_token(10.037)  # P/D decode stage: its prompt was prefilled elsewhere
    _relay(a, _stream_chunk("b"), 10.04)
    _relay(a, _stream_chunk("c"), 10.05)
    _relay(a, USAGE, 10.05)  # 32 of 120 prompt tokens were cached
    load.release(a, True, 10.06)
    assert seen == [{"prefill_tokens_per_step": pytest.approx(100 / 2)}]  # 2 decode steps
    assert load.state.values[0, StateColumn.PREFILL_TOKENS_PER_STEP] > 0
    assert load.state.values[1, StateColumn.PREFILL_TOKENS_PER_STEP] == 0
    assert load.interleave.uncached_share[0] < 1.0  # later prompts count 88/120 of theirs
    for attempt in (queued, other, elsewhere, pd):
        load.release(attempt, False, 10.07)


def test_a_stream_reports_its_realised_slo_outcome_to_the_reject_bound() -> None:
    """TTFT (forward -> first token) and TPOT of a streamed answer against the request's
    SLOs; a P/D decode stage counts by its TPOT only; a request without SLO not at all."""
    _, policy, load = _load()
    slo = MarginalRequest(
        key_hash=1, row=0, prompt_tokens=100, prefix=b"x", slo_ttft_s=0.5, slo_tpot_s=0.05
    )
    bound = policy.reject_bound(slo)

    def stream(route: MarginalRequest, first_s: float, gap_s: float, decode: bool) -> None:
        a = load.admit(0, route, 10.0, decode_stage=decode)
        a.first_token(10.0 + first_s)
        for i, token in enumerate("abc"):
            _relay(a, _stream_chunk(token, role=i == 0), 10.0 + first_s + i * gap_s)
        load.release(a, True, 10.0 + first_s + 3 * gap_s)

    stream(slo, 0.2, 0.01, decode=False)  # met
    assert (bound.outcomes, bound.miss_fraction) == (1, pytest.approx(1 / 3))
    stream(slo, 0.9, 0.01, decode=False)  # TTFT missed
    stream(slo, 0.2, 0.2, decode=False)  # TPOT missed
    assert (bound.outcomes, bound.miss_fraction) == (3, pytest.approx(3 / 5))
    stream(slo, 5.0, 0.01, decode=True)  # a decode stage's TTFT is not the client's: met
    assert (bound.outcomes, bound.miss_fraction) == (4, pytest.approx(3 / 6))
    stream(ROUTE, 5.0, 0.2, decode=False)  # no SLO: not counted
    assert bound.outcomes == 4 and policy.reject_bound(ROUTE).outcomes == 0
