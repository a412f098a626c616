"""Harness for proxy tests: real emulated engines + the real proxy on loopback.

Pattern: every test is a sync function that runs one coroutine with :func:`run`
(``asyncio.run`` under a hard timeout). Inside, :func:`proxy_stack` starts an
``EmulatedFleet`` on ephemeral ports, writes a config naming those ports, and serves
``make_app(config)`` through ``web.AppRunner`` + ``TCPSite`` on 127.0.0.1:0 with
``handler_cancellation=True`` (as ``fastroute serve`` does). The official ``openai``
client (sync, ``max_retries=0``) is called through ``asyncio.to_thread`` so the
proxy and the engines keep running on the test's loop while it blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
from aiohttp import web

from fastroute.config import Config, decode_config
from fastroute.emulator.model import EngineConfig, OutputLengthDistribution
from fastroute.emulator.server import EmulatedFleet, fleet_specs
from fastroute.proxy.app import CONTEXT, make_app
from fastroute.proxy.handler import ProxyContext
from fastroute.testing.waiting import wait_until

MODEL = "demo-8b"
RUN_TIMEOUT_S = 30.0
#: Short outputs (median ~4 tokens) keep requests without max_tokens fast.
SHORT_OUTPUTS = OutputLengthDistribution(mu=1.4, sigma=0.2)


def run(coro: Coroutine[Any, Any, Any], timeout: float = RUN_TIMEOUT_S) -> Any:
    """Run ``coro`` on a fresh event loop, failing after ``timeout`` seconds."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


#: Upstream timeouts of test configs, seconds (a test may override some).
TIMEOUTS = {"connect_timeout_s": 1.0, "first_byte_timeout_s": 5.0, "idle_timeout_s": 5.0}


def config_toml(
    urls: list[str],
    extra: str = "",
    table_name: str | None = None,
    timeouts: dict[str, float] | None = None,
) -> str:
    """A config for engines ``engine-<i>`` at ``urls`` serving :data:`MODEL`."""
    timeouts = {**TIMEOUTS, "total_timeout_s": 20.0, **(timeouts or {})}
    engines = "".join(
        f'[[engines]]\nname = "engine-{i}"\nurl = "{url}"\nmodels = ["{MODEL}"]\n'
        f'hardware = "h100"\ncapacity_rps = 10.0\n\n'
        for i, url in enumerate(urls)
    )
    table = table_name or f"fastroute-test-absent-{uuid.uuid4().hex[:12]}"
    return (
        engines
        + extra
        + f'\n[proxy]\nport = 0\ntable_name = "{table}"\n'
        + "\n[timeouts]\n"
        + "".join(f"{k} = {v}\n" for k, v in timeouts.items())
    )


@dataclass
class Stack:
    """A running fleet + proxy."""

    fleet: EmulatedFleet
    config: Config
    app: web.Application
    runner: web.AppRunner
    url: str
    closed: bool = False

    async def drain(self) -> None:
        """Shut the proxy down as SIGTERM does: stop listening, let requests finish."""
        self.closed = True
        await self.runner.cleanup()

    @property
    def ctx(self) -> ProxyContext:
        """The proxy's shared state."""
        return self.app[CONTEXT]

    def client(self) -> openai.OpenAI:
        """A sync ``openai`` client for the proxy (no client-side retries)."""
        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=15.0)


@contextlib.asynccontextmanager
async def proxy_stack(
    n_engines: int = 3,
    *,
    extra: str = "",
    table_name: str | None = None,
    engine_config: EngineConfig | None = None,
    timeouts: dict[str, float] | None = None,
) -> AsyncIterator[Stack]:
    """Start ``n_engines`` emulated engines and a proxy in front of them."""
    specs = fleet_specs(
        n_engines,
        model_name=MODEL,
        profile="h100",
        output_lengths=SHORT_OUTPUTS,
        config=engine_config or EngineConfig(),
    )
    async with EmulatedFleet(specs) as fleet:
        config = decode_config(
            config_toml(fleet.urls, extra, table_name, timeouts), source="test.toml"
        )
        app = make_app(config)
        runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0
        )
        await runner.setup()
        stack: Stack | None = None
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            stack = Stack(fleet, config, app, runner, f"http://127.0.0.1:{port}")
            yield stack
        finally:
            if stack is None or not stack.closed:
                await runner.cleanup()


async def read_sse(resp: aiohttp.ClientResponse) -> tuple[list[dict[str, Any]], bool]:
    """Read an SSE body to its end: (parsed events before ``[DONE]``, saw ``[DONE]``)."""
    events: list[dict[str, Any]] = []
    done = False
    async for raw in resp.content:
        line = raw.strip()
        if not line:
            continue
        assert line.startswith(b"data: "), line
        if line == b"data: [DONE]":
            done = True
            continue
        events.append(json.loads(line[6:]))
    return events, done


def chat_body(user: str, *, system: str = "You are terse.", **extra: Any) -> dict[str, Any]:
    """A chat request body for :data:`MODEL`."""
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 4,
        **extra,
    }


class Harness:
    """The helpers above, handed to tests by the :func:`h` fixture."""

    MODEL = MODEL
    run = staticmethod(run)
    wait_until = staticmethod(wait_until)
    proxy_stack = staticmethod(proxy_stack)
    read_sse = staticmethod(read_sse)
    chat_body = staticmethod(chat_body)
