"""Harness for proxy tests: real emulated engines + the real proxy on loopback.

Pattern: every test is a sync function that runs one coroutine with :func:`run`
(``asyncio.run`` under a hard timeout). Inside, :func:`proxy_stack` starts an
``EmulatedFleet`` on ephemeral ports, writes a config naming those ports, and serves
``ProxyApp(config)`` on 127.0.0.1:0 with the lean server (:class:`LeanServer`), as
``fastroute serve`` workers do. The official ``openai``
client (sync, ``max_retries=0``) is called through ``asyncio.to_thread`` so the
proxy and the engines keep running on the test's loop while it blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai

from fastroute.config import Config, decode_config
from fastroute.emulator.model import EngineConfig, OutputLengthDistribution
from fastroute.emulator.server import EmulatedFleet, EngineSpec, fleet_specs
from fastroute.proxy.http.server import LeanServer
from fastroute.proxy.path.handler import ProxyContext
from fastroute.proxy.proxy_app import ProxyApp
from fastroute.testing.configs import engines_toml
from fastroute.testing.servers import serve_proxy_app
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
    *,
    names: Sequence[str] | None = None,
    roles: Sequence[str] | None = None,
) -> str:
    """A config for engines at ``urls`` serving :data:`MODEL` (named ``engine-<i>`` unless
    ``names``; ``roles`` for P/D)."""
    timeouts = {**TIMEOUTS, "total_timeout_s": 20.0, **(timeouts or {})}
    engines = engines_toml(urls, MODEL, names=names, roles=roles)
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
    app: ProxyApp
    url: str
    server: LeanServer

    async def drain(self) -> None:
        """Shut the proxy down as SIGTERM does: stop listening, let requests finish."""
        await self.server.drain(5.0)
        await self.app.stop()

    @property
    def ctx(self) -> ProxyContext:
        """The proxy's shared state."""
        return self.app.context

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
    engine_options: dict[str, Any] | None = None,
) -> AsyncIterator[Stack]:
    """Start ``n_engines`` emulated engines and a proxy in front of them
    (``engine_options``: more :class:`EngineSpec` fields, e.g. ``stream_interval`` or the
    ``kind`` of engine they behave like)."""
    specs = fleet_specs(
        n_engines,
        model_name=MODEL,
        profile="h100",
        output_lengths=SHORT_OUTPUTS,
        config=engine_config or EngineConfig(),
        **(engine_options or {}),
    )
    async with EmulatedFleet(specs) as fleet:
        config = decode_config(
            config_toml(fleet.urls, extra, table_name, timeouts), source="test.toml"
        )
        async with serve_proxy(config) as (app, url, server):
            yield Stack(fleet, config, app, url, server)


#: Roles of the P/D fleet of :func:`pd_stack` (engines ``prefill-0`` ... ``decode-3``).
PD_ROLES = ("prefill", "prefill", "decode", "decode")


@contextlib.asynccontextmanager
async def pd_stack(extra: str = "") -> AsyncIterator[tuple[EmulatedFleet, ProxyContext, str]]:
    """Two prefill and two decode emulated engines behind the proxy (``extra``: more config):
    (fleet, the proxy's context, the proxy's URL)."""
    names = [f"{role}-{i}" for i, role in enumerate(PD_ROLES)]
    specs = [
        EngineSpec(
            name=name,
            model_name=MODEL,
            profile="h100",
            role=role,
            seed=i,
            output_lengths=SHORT_OUTPUTS,
        )
        for i, (name, role) in enumerate(zip(names, PD_ROLES, strict=True))
    ]
    async with EmulatedFleet(specs) as fleet:
        toml = config_toml(fleet.urls, extra, names=names, roles=PD_ROLES)
        async with serve_proxy(decode_config(toml, source="pd.toml")) as (app, url, _):
            yield fleet, app.context, url


@contextlib.asynccontextmanager
async def serve_proxy(
    config: Config, *, keepalive_s: float = 75.0
) -> AsyncIterator[tuple[ProxyApp, str, LeanServer]]:
    """Serve ``ProxyApp(config)`` on 127.0.0.1:0 with the lean server: (app, url, server)."""
    app = ProxyApp(config)
    async with serve_proxy_app(app, keepalive_s=keepalive_s) as (url, server):
        yield app, url, server


async def decision_record(s: aiohttp.ClientSession, url: str, rid: str) -> dict[str, Any]:
    """The proxy's decision record of request ``rid`` (``GET /admin/decisions/{rid}``)."""
    async with s.get(url + f"/admin/decisions/{rid}") as resp:
        assert resp.status == 200
        return dict(await resp.json())


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
