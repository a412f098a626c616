"""Counters of engines and proxies read from real ``/metrics`` pages on loopback."""

from __future__ import annotations

import asyncio

import openai
import pytest
from aiohttp import web

from fastroute.emulator.server import EmulatedFleet, EngineSpec
from fastroute.fleetbench.scrape import scrape_engines, scrape_proxies
from fastroute.testing.processes import free_port
from fastroute.testing.servers import serve_app

pytestmark = pytest.mark.integration

PROXY_PAGE = (
    "# TYPE fastroute_proxy_retries_total counter\n"
    'fastroute_proxy_retries_total{reason="a"} 2\n'
    'fastroute_proxy_retries_total{reason="b"} 3\n'
    "# TYPE fastroute_proxy_shed_total counter\n"
    "fastroute_proxy_shed_total 4\n"
)


def test_engine_and_proxy_counters_and_none_for_a_silent_server() -> None:
    """Engine counters count the requests sent (labels summed); proxy counters sum their
    labels, absent ones are 0; a server that does not answer is None, not an error."""

    async def main() -> None:
        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text=PROXY_PAGE)

        proxy = web.Application()
        proxy.router.add_get("/metrics", metrics)
        gone = f"http://127.0.0.1:{free_port()}"
        spec = EngineSpec(name="e0", model_name="m", profile="h100", port=0)
        async with EmulatedFleet([spec]) as fleet, serve_app(proxy) as proxy_url:
            async with openai.AsyncOpenAI(
                base_url=fleet.urls[0] + "/v1", api_key="x", max_retries=0
            ) as client:
                for _ in range(3):
                    await client.completions.create(model="m", prompt="hi there", max_tokens=2)
            engines = await scrape_engines({"e0": fleet.urls[0], "gone": gone}, timeout_s=5.0)
            proxies = await scrape_proxies({"p": proxy_url, "gone": gone}, timeout_s=5.0)
        e0 = engines["e0"]
        assert e0 is not None and e0.requests == 3.0 and e0.prompt_tokens > 0
        assert 0 < e0.generation_tokens <= 6.0 and engines["gone"] is None  # max_tokens 2
        p = proxies["p"]
        assert p is not None and (p.retries, p.retry_refused, p.shed) == (5.0, 0.0, 4.0)
        assert proxies["gone"] is None

    asyncio.run(asyncio.wait_for(main(), 30.0))
