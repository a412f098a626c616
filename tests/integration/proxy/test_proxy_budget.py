"""Retry budget under a fleet where every engine fails half its requests.

Set-up: 4 emulated engines, each answering 50 % of new requests at once with 503
(``error_rate`` fault); the proxy in front (``retry.max_retries = 1``, top-k 3, so
every request has a second candidate). Attempts are counted by the engines
themselves: finished requests (``EngineModel.finished_total``) + injected errors.

Bound (fastroute/guards/retry_budget.py, docs/algorithms.md §3): retries over a run are at
most ``ratio × requests + min_retries_per_s × ttl_s`` per budget window, so attempts
per request ≤ ``1 + ratio + floor × ttl_s / requests``. The whole run fits inside one
window (``ttl_s`` = 30 s, the test is capped at 20 s), so nothing expires and the
``floor / rate`` term is exactly ``floor × ttl_s / requests``. Noise margin: 1 attempt,
because the budget compares float balances (``ratio × deposits`` is not exact in
binary, e.g. 0.1 × 400) and may grant one retry at the boundary; nothing else is
approximate (the count is at the engines, which see every attempt exactly once; no
connection errors occur on loopback). Without a budget the expected rate is
1 + 0.5 = 1.5 attempts per request, far above the 1.175 bound, so the test fails if
the budget leaks.

Ejection is disabled in effect (``consecutive_failures = 1000``): with the default 5,
an engine failing 5 times in a row (likely in 400 requests at 50 %) would be ejected
for 30 s, shrinking the pool so that some requests have no second candidate — that
lowers attempts and would hide a leak rather than reveal one; the bound is about the budget alone.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from proxy_harness import Harness, Stack

pytestmark = pytest.mark.integration

N_REQUESTS = 400
CONCURRENCY = 16
N_ENGINES = 4
TTL_S = 30.0
#: 1000 consecutive failures (the maximum) never happen at a 50 % failure rate.
NO_EJECTION = "[ejection]\nconsecutive_failures = 1000\n"


def _retry_section(ratio: float, floor: float) -> str:
    return (
        f"[retry]\nratio = {ratio}\nmin_retries_per_s = {floor}\nttl_s = {TTL_S}\n"
        "max_retries = 1\n\n[policy]\ntop_k = 3\n\n" + NO_EJECTION
    )


def _engine_attempts(st: Stack) -> int:
    """Chat requests the engines received: finished ones + those failed by the fault."""
    return sum(
        sum(e.model.finished_total.values()) + e.faults.injected_total["error"]
        for e in st.fleet.engines
    )


async def _flaky_run(h: Harness, ratio: float, floor: float) -> tuple[Stack, dict[int, int], float]:
    """Send N_REQUESTS through a proxy over half-failing engines; statuses by code."""
    statuses: dict[int, int] = {}
    async with h.proxy_stack(N_ENGINES, extra=_retry_section(ratio, floor)) as st:
        for engine in st.fleet.engines:
            await engine.set_faults(error_rate=0.5, error_status=503)
        assert _engine_attempts(st) == 0
        queue = list(range(N_REQUESTS))
        started = time.monotonic()
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(timeout=timeout) as session:

            async def worker() -> None:
                while queue:
                    i = queue.pop()
                    body = h.chat_body(f"request {i}", max_tokens=1)
                    async with session.post(st.url + "/v1/chat/completions", json=body) as resp:
                        await resp.read()
                        statuses[resp.status] = statuses.get(resp.status, 0) + 1

            await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        elapsed = time.monotonic() - started
        await h.wait_until(lambda: _engine_attempts(st) >= sum(statuses.values()), timeout=2.0)
        return st, statuses, elapsed


def test_attempts_per_request_stay_within_the_budget_bound(h: Harness) -> None:
    """With every engine failing half its requests, attempts/request ≤ 1 + ratio + floor/rate."""
    ratio, floor = 0.1, 1.0

    async def main() -> None:
        st, statuses, elapsed = await _flaky_run(h, ratio, floor)
        budget = st.ctx.budget
        attempts = _engine_attempts(st)
        assert elapsed < TTL_S - 1.0, "the run must fit in one budget window"
        assert sum(statuses.values()) == N_REQUESTS
        assert set(statuses) <= {200, 502}, statuses
        assert budget.deposits_total == N_REQUESTS
        # The engines saw exactly the original requests plus the retries the budget allowed.
        assert attempts == N_REQUESTS + budget.retries_allowed_total
        bound = N_REQUESTS * (1 + ratio + floor * TTL_S / N_REQUESTS) + 1
        assert attempts <= bound, (attempts, bound)
        # Retries happened, and the budget (not a lack of failures) is what stopped more.
        assert budget.retries_allowed_total > 0
        assert budget.retries_refused_total > 0
        assert statuses.get(502, 0) > 0

    h.run(main(), timeout=20.0)


def test_no_retries_without_a_budget(h: Harness) -> None:
    """With ratio 0 and floor 0 the budget allows no retry at all."""

    async def main() -> None:
        st, statuses, _ = await _flaky_run(h, 0.0, 0.0)
        budget = st.ctx.budget
        assert sum(statuses.values()) == N_REQUESTS
        assert _engine_attempts(st) == N_REQUESTS
        assert budget.retries_allowed_total == 0
        # About half the requests failed and wanted a retry; every one was refused.
        assert budget.retries_refused_total == statuses.get(502, 0) > N_REQUESTS // 4

    h.run(main(), timeout=20.0)
