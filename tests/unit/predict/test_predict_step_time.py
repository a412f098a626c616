"""Step features, and the calibrated model fitted to the emulator's own step times."""

from __future__ import annotations

import pytest

from fastroute.emulator.model import EngineConfig, EngineModel, Phase, Request
from fastroute.hardware import get_profile
from fastroute.predict import (
    COEF_NAMES,
    NominalStepTimes,
    StepTimeModel,
    chunk_sums,
    prefill_features,
    step_features,
)

PROFILE = get_profile("a40")
TRUE = NominalStepTimes.from_profile(PROFILE)


@pytest.mark.parametrize("n", [1, 15, 2048, 2049, 5000, 8192])
@pytest.mark.parametrize("c", [0, 7, 3000])
@pytest.mark.parametrize("budget", [512, 2048])
def test_chunk_sums_match_the_chunk_loop(n, c, budget):
    """The closed form equals summing the chunks one by one."""
    steps = sq = nc = 0
    done = 0
    while done < n:
        chunk = min(budget, n - done)
        steps += 1
        sq += chunk * chunk
        nc += chunk * (c + done)
        done += chunk
    assert chunk_sums(n, c, budget) == (steps, sq, nc)


def test_prefill_features_give_the_profile_prefill_time():
    """One chunk without decodes: features · coefficients = HardwareProfile.prefill_time_s."""
    model = StepTimeModel(TRUE)
    f = prefill_features(1500, 300, budget=TRUE.max_num_batched_tokens)
    assert model.predict(f) == pytest.approx(PROFILE.prefill_time_s(1500, 300), rel=1e-12)
    assert model.prefill_s(1500, 300) == pytest.approx(PROFILE.prefill_time_s(1500, 300))
    assert model.decode_step_s(12, 9000) == pytest.approx(PROFILE.decode_time_s(12, 9000))


def emulator_steps(rand, n_requests: int) -> list[tuple[list[float], float]]:
    """Run an EngineModel over a bursty mix (shared prefixes, chunked long prompts, mixed
    steps) and return each step's exact features and the duration the emulator gave it."""
    model = EngineModel(PROFILE, EngineConfig(max_num_seqs=64), seed=1)
    shared = tuple(range(10_000, 10_064))  # a 1024-token common prefix, as block hashes
    arrivals, t = [], 0.0
    for i in range(n_requests):
        t += rand.expovariate(2.0)
        prompt = rand.randint(16, 3000)
        blocks = prompt // 16
        if rand.random() < 0.4 and blocks > 64:
            hashes = shared + tuple(1_000_000 * (i + 1) + j for j in range(blocks - 64))
        else:
            hashes = tuple(1_000_000 * (i + 1) + j for j in range(blocks))
        req = Request(f"r{i}", prompt, hashes, output_tokens=rand.randint(5, 60))
        arrivals.append((t, req))
    live: list[Request] = []
    out = []
    idx, now = 0, 0.0
    for _ in range(100_000):
        nxt = model.next_step_time(now)
        if idx < len(arrivals) and (nxt is None or arrivals[idx][0] <= nxt):
            now = max(now, arrivals[idx][0])
            model.submit(arrivals[idx][1], now)
            live.append(arrivals[idx][1])
            idx += 1
            continue
        if nxt is None:
            break
        now = nxt
        before = {
            id(r): (r.phase, r.num_computed, r.num_output)
            for r in live
            if r.phase in (Phase.WAITING, Phase.RUNNING)
        }
        res = model.step(now)
        assert not res.preempted
        batch = context = new = new_sq = new_cached = 0
        for r in live:
            if id(r) not in before:
                continue
            phase, computed, emitted = before[id(r)]
            if phase is Phase.WAITING:
                if r.phase is Phase.WAITING:
                    continue
                computed = r.num_cached_tokens  # admitted now: prefix-cache hit counts as done
            n = r.num_computed - computed
            if n <= 0:
                continue
            if n == 1 and emitted and computed + 1 == r.num_prompt_tokens + emitted:
                batch += 1
                context += r.num_prompt_tokens + emitted
            else:
                new += n
                new_sq += n * n
                new_cached += n * computed
        assert (batch, context, new) == (
            res.num_decode_seqs,
            res.num_decode_context_tokens,
            res.num_prefill_tokens,
        )
        if not res.idle:
            out.append((step_features(batch, context, new, new_sq, new_cached), res.duration_s))
        live = [r for r in live if r.phase in (Phase.WAITING, Phase.RUNNING)]
    assert idx == len(arrivals) and not live
    return out


def test_rls_fitted_to_emulator_timings_predicts_its_step_times(rand):
    """Starting from constants 1.5x off (truth withheld), the fit to the emulator's steps
    predicts held-out steps to within 1 % (median) and recovers its main coefficients."""
    steps = emulator_steps(rand, 200)
    assert len(steps) > 500
    assert any(f[0] == 0.0 and f[4] > 0 for f, _ in steps)  # mixed steps were exercised
    split = int(len(steps) * 0.7)
    model = StepTimeModel(TRUE.scaled(1.5))
    for f, y in steps[:split]:
        model.observe(f, y, kind="prefill" if f[4] else "decode")
    errors = sorted(abs(model.predict(f) / y - 1.0) for f, y in steps[split:])
    assert errors[len(errors) // 2] < 0.01
    assert errors[int(len(errors) * 0.99)] < 0.08
    coef = dict(zip(COEF_NAMES, model.rls.coef, strict=True))
    # The dominant terms are recovered; a0 (only prefill-only steps excite it) and b1 (a
    # few % of a decode step) converge more slowly and are checked loosely.
    for name in ("b0_s", "b2_s", "a1_s"):
        assert coef[name] == pytest.approx(getattr(TRUE, name), rel=0.05), name
    for name in ("a0_s", "b1_s"):
        assert coef[name] == pytest.approx(getattr(TRUE, name), rel=0.5), name
