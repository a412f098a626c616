"""Metric names: those a PromQL expression reads, and those a live fastroute stack exports.

:func:`promql_metric_names` is a small tokenizer, enough for the expressions of deploy/: it drops
strings, label matchers ``{…}``, ranges ``[…]``, grouping clauses ``by (…)`` and the like, function
names (an identifier followed by ``(``) and keywords; what is left are metric names.
:func:`exported_names` scrapes a real stack: emulated engines, the controller app and a proxy on
loopback sharing one table, after a few requests, so labelled series exist.
"""

from __future__ import annotations

import asyncio
import re
import uuid

import aiohttp

from controller.app import SERVICE, make_app
from fastroute.config import decode_config
from fastroute.emulator.server import EmulatedFleet, fleet_specs
from fastroute.proxy.proxy_app import ProxyApp
from fastroute.signals.dialects import VLLM
from fastroute.tables.segment import shm_dir
from fastroute.testing.configs import engines_toml
from fastroute.testing.servers import serve_app, serve_proxy_app
from fastroute.testing.waiting import wait_until

MODEL = "demo-8b"
_KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "or", "and", "unless",
     "bool", "offset", "inf", "nan"}
)  # fmt: skip
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def promql_metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` reads (grafana variables such as ``$__rate_interval`` dropped)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = _GROUPING.sub(" ", text)
    text = re.sub(r"\$\w+", " ", text)
    names = set()
    for m in _IDENT.finditer(text):
        rest = text[m.end() :].lstrip()
        word = m.group()
        if rest.startswith("(") or word.lower() in _KEYWORDS:
            continue
        if m.start() > 0 and (text[m.start() - 1].isdigit() or text[m.start() - 1] == "."):
            continue  # a unit or exponent of a number
        names.add(word)
    return names


def vllm_names() -> set[str]:
    """vLLM's sample names fastroute reads (:data:`fastroute.signals.dialects.VLLM`)."""
    hist = {f"{h}{s}" for h in VLLM.histograms for s in ("_bucket", "_sum", "_count")}
    return set(VLLM.scalars) | hist


def _families(text: str) -> set[str]:
    """Sample names of a Prometheus text page, plus every series a ``# TYPE`` line implies."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            names.add(name)
            if kind == "counter":
                names.add(name if name.endswith("_total") else name + "_total")
            elif kind == "histogram":
                names |= {name + s for s in ("_bucket", "_sum", "_count")}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


def _config_toml(urls: list[str], table: str, controller_url: str = "") -> str:
    """The stack's config; with ``controller_url`` the proxy's (its own table, pulled from the
    controller, and reports to it: the remote-proxy metrics exist only then)."""
    proxy = (
        f'[proxy]\nport = 0\ntable_name = "{table}-proxy"\nstats_name = "{table}-stats"\n'
        f'controller_url = "{controller_url}"\nscrape_engines = true\n'
        "scrape_interval_s = 0.2\nscrape_timeout_s = 0.1\nreport_interval_s = 0.2\n"
        # a peer that refuses every poll: the peer-poll families exist (with outcome failed)
        'peers = ["http://127.0.0.1:9"]\npeer_poll_interval_s = 0.2\n'
    )
    return (
        engines_toml(urls, MODEL)
        + "[controller]\nport = 0\nperiod_s = 0.2\nsolve_time_limit_s = 0.15\n"
        + "scrape_interval_s = 0.2\nscrape_timeout_s = 0.1\n\n"
        + (proxy if controller_url else f'[proxy]\ntable_name = "{table}"\n')
    )


async def _scrape_stack(table: str) -> dict[str, set[str]]:
    specs = fleet_specs(2, model_name=MODEL, profile="h100")
    async with EmulatedFleet(specs) as fleet:
        app = make_app(decode_config(_config_toml(fleet.urls, table), source="controller.toml"))
        async with serve_app(app) as ctl_url:
            svc = app[SERVICE]
            config = decode_config(_config_toml(fleet.urls, table, ctl_url), source="proxy.toml")
            async with serve_proxy_app(ProxyApp(config)) as (proxy_url, _):
                async with aiohttp.ClientSession() as s:
                    body = {"model": MODEL, "max_tokens": 4, "stream": True,
                            "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
                    for _ in range(4):
                        async with s.post(proxy_url + "/v1/chat/completions", json=body) as r:
                            assert r.status == 200, await r.text()
                            await r.read()
                    await wait_until(lambda: svc.periods_total >= 3, timeout=10.0)
                    await asyncio.sleep(0.5)  # one more scrape and report round
                    pages = {}
                    for role, url in (("proxy", proxy_url), ("controller", ctl_url),
                                      ("engine", fleet.urls[0])):  # fmt: skip
                        async with s.get(url + "/metrics") as r:
                            assert r.status == 200
                            pages[role] = _families(await r.text())
                    return pages


def exported_names() -> dict[str, set[str]]:
    """Per role (proxy, controller, engine: an emulated vLLM) the names its ``/metrics`` has."""
    table = f"fastroute-test-metrics-{uuid.uuid4().hex[:12]}"
    try:
        return asyncio.run(asyncio.wait_for(_scrape_stack(table), 30.0))
    finally:
        for suffix in ("", ".lock", ".tmp", "-proxy", "-proxy.lock", "-stats", "-stats.lock"):
            (shm_dir() / (table + suffix)).unlink(missing_ok=True)
