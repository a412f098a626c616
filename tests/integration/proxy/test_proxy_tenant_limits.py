"""Tenant limits through a real ``fastroute serve --workers 2`` and the official openai client.

The two workers share one per-tenant counter block, so the tenant's 5 requests/min hold
for the proxy as a whole; the client sees the 429s as ``openai.RateLimitError`` with
``Retry-After`` and OpenAI's ``x-ratelimit-*`` headers, and the admitted answers carry
the same headers.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import openai
import pytest
from proxy_harness import MODEL, Harness, config_toml
from test_proxy_workers import engines, shm, spawn, wait_workers  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration

TENANTS = """
[[tenants]]
name = "acme"
api_keys = ["sk-acme-test"]
requests_per_min = 5
tokens_per_min = 100000
"""

RESET = re.compile(r"^(\d+ms|(\d+m)?\d+(\.\d+)?s)$")


def _ask(url: str) -> tuple[str, Any]:
    """One chat request on a fresh client (a new connection: SO_REUSEPORT spreads them)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="sk-acme-test", max_retries=0)
    try:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        return "ok", raw.headers
    except openai.RateLimitError as exc:
        return "limited", exc
    finally:
        client.close()


def test_two_workers_share_the_tenant_limit_and_the_client_sees_rate_limit_errors(
    h: Harness,
    spawn: Any,  # noqa: F811 - the fixture
) -> None:
    async def main() -> None:
        async with engines(2) as fleet:
            proxy = spawn(config_toml(fleet.urls, TENANTS), workers=2)
            await wait_workers(h, proxy, 2)
            results: list[tuple[str, Any]] = []
            workers: set[str] = set()
            # Until both workers answered (bounded): the limit is the proxy's, not a worker's.
            while len(workers) < 2 or len(results) < 8:
                assert len(results) < 40, f"one worker answered everything\n{proxy.logs()}"
                kind, got = await asyncio.to_thread(_ask, proxy.url)
                headers = got if kind == "ok" else got.response.headers
                workers.add(headers["x-fastroute-worker"])
                results.append((kind, got))
        admitted = [headers for kind, headers in results if kind == "ok"]
        limited = [exc for kind, exc in results if kind == "limited"]
        assert len(admitted) == 5, (len(admitted), proxy.logs())
        assert len(limited) == len(results) - 5
        first = admitted[0]
        assert first["x-ratelimit-limit-requests"] == "5"
        assert first["x-ratelimit-remaining-requests"] == "4"
        assert first["x-ratelimit-limit-tokens"] == "100000"
        assert RESET.match(first["x-ratelimit-reset-requests"]), first
        exc = limited[0]
        assert exc.status_code == 429
        assert exc.code == "rate_limit_exceeded"
        head = exc.response.headers
        assert int(head["retry-after"]) >= 1
        assert head["x-ratelimit-limit-requests"] == "5"
        assert head["x-ratelimit-remaining-requests"] == "0"
        assert RESET.match(head["x-ratelimit-reset-requests"]), head
        assert RESET.match(head["x-ratelimit-reset-tokens"]), head
        assert "acme" in exc.message

    h.run(main(), timeout=60.0)
