"""EngineModel.fast_forward (decode fast-forward) against step-by-step stepping."""

from __future__ import annotations

import math
import random

import pytest

from fastroute.emulator.model import EngineConfig, EngineModel, Request
from fastroute.hardware import get_profile


def _model(num_blocks: int | None = None) -> EngineModel:
    return EngineModel(get_profile("a100"), EngineConfig(num_blocks=num_blocks), seed=1)


def _load(model: EngineModel, rng: random.Random, n: int) -> None:
    for i in range(n):
        prompt = rng.randint(20, 900)
        hashes = [rng.getrandbits(63) for _ in range(prompt // 16)]
        out = rng.randint(2, 300)
        model.submit(Request(f"r{i}", prompt, hashes, output_tokens=out), 0.0)


def _state(model: EngineModel) -> tuple:
    reqs = sorted(model._live.values(), key=lambda r: r.request_id)  # noqa: SLF001
    return (
        model.busy_until_s,
        model.generation_tokens_total,
        model.num_steps_total,
        model.kv.num_free,
        model.kv.num_used,
        [(r.request_id, r.num_computed, r.num_output, r.num_private, r.last_token_s) for r in reqs],
    )


def _steps_until_decode_only(model: EngineModel) -> float:
    """Step until a fast-forward is possible (prompts done, nobody on its last token)."""
    t = 0.0
    for _ in range(10_000):
        if model.fast_forward(t, dry_run=True)[0]:
            return t
        t = model.step(model.next_step_time(t)).end_s
    raise AssertionError("never reached a decode-only state")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fast_forward_equals_stepping(seed):
    """Applying k unobservable decode steps in one call leaves the model bit-identical to
    k step() calls (times, counters, KV blocks), and none of those steps emitted a first
    or a last token."""
    rng = random.Random(seed)
    a, b = _model(), _model()
    _load(a, random.Random(seed), 12)
    _load(b, random.Random(seed), 12)
    t = _steps_until_decode_only(a)
    assert _steps_until_decode_only(b) == t
    until = t + rng.uniform(0.05, 2.0)
    k, end, busy = a.fast_forward(t, until)
    assert k > 0
    n = 0
    while n < k:
        res = b.step(t)
        assert not res.finished and all(r.num_output > 1 for r in res.emitted)
        t = res.end_s
        n += 1
    assert _state(a) == _state(b)
    assert end == t and busy == pytest.approx(end - (end - busy))


def test_dry_run_predicts_without_changing():
    """A dry run returns what an application up to its end applies, and changes nothing."""
    m = _model()
    _load(m, random.Random(9), 8)
    t = _steps_until_decode_only(m)
    before = _state(m)
    k, end, busy = m.fast_forward(t, dry_run=True)
    assert _state(m) == before and k > 0
    assert m.fast_forward(t, end) == (k, end, busy)


def test_no_fast_forward_when_something_is_observable():
    """Nothing is skipped with a request waiting, a prefill running or a token about to end
    a request; nor past until_s."""
    m = _model()
    _load(m, random.Random(4), 3)
    assert m.fast_forward(0.0, math.inf) == (0, 0.0, 0.0)  # prompts still to compute
    t = _steps_until_decode_only(m)
    last = _model()
    last.submit(Request("one", 40, output_tokens=2), 0.0)
    t1 = last.step(0.0).end_s
    assert last.fast_forward(t1, math.inf) == (0, t1, 0.0)  # the next token is its last
    assert m.fast_forward(t, t) == (0, t, 0.0)
    m.submit(Request("late", 50, output_tokens=3), t)
    assert m.fast_forward(t, math.inf)[0] == 0


def test_no_fast_forward_without_kv_room():
    """If the skipped steps need more KV blocks than the cache can give, step() must run
    (it would preempt)."""
    m = _model(num_blocks=60)
    m.submit(Request("a", 300, output_tokens=400), 0.0)
    m.submit(Request("b", 300, output_tokens=400), 0.0)
    t = 0.0
    while any(r.num_output == 0 for r in m._running) or m.num_waiting:  # noqa: SLF001
        t = m.step(m.next_step_time(t)).end_s
    assert m.fast_forward(t, math.inf, dry_run=True)[0] == 0  # needs 50 blocks, 22 left
    assert m.fast_forward(t, math.inf)[0] == 0
