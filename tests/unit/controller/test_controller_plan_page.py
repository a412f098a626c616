"""The plan page (controller.plan_page, ``GET /plan``): rendering, escaping, tolerance, route."""

from __future__ import annotations

import asyncio
import html
import re
from html.parser import HTMLParser
from typing import Any

import aiohttp
from aiohttp import web

from controller.app import SERVICE, make_app
from controller.plan_page import render_plan_html
from fastroute.config import decode_config

MODEL = "demo-8b"
HOSTILE = '<script>alert("x")</script>&"\'engine'


def _config_toml(table_name: str) -> str:
    engines = "".join(
        f'[[engines]]\nname = "engine-{i}"\nurl = "http://127.0.0.1:{9 + i}"\n'
        f'models = ["{MODEL}"]\nregion = "{("east", "west")[i // 2]}"\nhardware = "h100"\n'
        "capacity_rps = 10.0\n\n"
        for i in range(4)
    )
    return (
        engines
        + '[[network.regions]]\nname = "east"\n\n[[network.regions]]\nname = "west"\n\n'
        + "[network.rtt_ms]\neast = { west = 80.0 }\n\n"
        + "[controller]\nport = 0\nperiod_s = 0.2\nsolve_time_limit_s = 0.15\n\n"
        + f'[proxy]\nport = 0\ncluster = "east"\ntable_name = "{table_name}"\n'
    )


class _Checker(HTMLParser):
    """Collects tags and text; fails on <script> or an unexpected attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        assert tag != "script"
        for name, _value in attrs:
            assert name in {
                "lang",
                "charset",
                "http-equiv",
                "content",
                "class",
                "style",
                "title",
                "href",
            }, name  # an injected attribute (onerror=…) would show up here
        self.tags.append(tag)

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _parse(page: str) -> _Checker:
    p = _Checker()
    p.feed(page)
    p.close()
    return p


def _plan() -> dict[str, Any]:
    """A hand-written plan with the shape of ``ControllerService.plan_json`` plus extras."""
    engines = [
        {
            "name": "engine-0",
            "capacity_rps": 10.0,
            "group": 0,
            "load_rps": 6.0,
            "region": "east",
            "hardware": "h100",
            "health_level": "ok",
        },
        {
            "name": HOSTILE,
            "capacity_rps": 20.0,
            "group": 1,
            "load_rps": 19.0,
            "region": "<b>west</b>",
            "hardware": "a100",
            "health_level": 0.5,
            "unavailable": True,
            "effective_capacity_rps": 10.0,
            "health_reason": "ttft > 3× profile <img src=x>",
            "why": "derated to 50 % <i>of</i> its capacity",
            "health_since": 1000.0,
            "signals": {"queue<len>": 4, "kv_usage": 0.91},
            "signals_at": 1090.0,
        },
    ]
    classes = [
        {
            "name": f"east/{MODEL}/default",
            "key": 1,
            "cluster": "east",
            "model": MODEL,
            "priority": "default",
            "demand_rps": 30.0,
            "measured": True,
            "shed_fraction": 1 / 6,
            "marginal_cost_s": 0.0421,
            "allocation_rps": {"engine-0": 6.0, HOSTILE: 19.0},
            "weights": {"engine-0": 0.24, HOSTILE: 0.76},
        },
        {
            "name": "west/m/batch",
            "key": 2,
            "cluster": "west",
            "model": "m<1>",
            "priority": "batch",
            "demand_rps": 0.0,
            "measured": False,
            "shed_fraction": 0.0,
            "marginal_cost_s": 0.0,
            "allocation_rps": {},
            "weights": {"engine-0": 1.0},
        },
    ]
    return {
        "plan_id": 7,
        "generation": 12,
        "period_s": 1.0,
        "periods_total": 40,
        "last_error": "Time limit <reached>",
        "live_workers": 2,
        "engines": engines,
        "classes": classes,
        "created_at": 1100.0,
        "retry_ratio": 0.02,
        "solve": {
            "status": "Optimal",
            "objective": 12.5,
            "solve_time_s": 0.004,
            "build_time_s": 0.001,
            "iterations": 17,
            "warm": True,
        },
    }


def test_renders_header_classes_and_engines() -> None:
    """Header, per class and per engine fields appear; the share bar covers demand and shed."""
    page = render_plan_html(_plan(), now=1100.0)
    text = " ".join(_parse(page).text)
    assert page.startswith("<!DOCTYPE html>") and '<meta http-equiv="refresh" content="5">' in page
    for needle in [
        "fastroute plan 7",
        "12",
        "Optimal",
        "4 ms",
        "17",
        "1 s",
        "measured",
        "default",
        "16.7%",
        "42.1 ms",
        "30 rps",
        "60.0%",
        "95.0%",
        "h100",
        "0.5",
        "unavailable",
        "(effective 10)",
        "100.0 s ago",
        "10.0 s ago",
        "kv_usage=0.91",
        "derated to 50 % <i>of</i> its capacity",  # the why line, escaped
    ]:
        assert needle in text, needle
    widths = [float(w) for w in re.findall(r"width:([0-9.]+)%", page)]
    assert widths == [63.33, 20.0, 16.67, 100.0]  # 19/30, 6/30, shed 1/6; 2nd class: weights
    assert 'class="shed"' in page and "<link" not in page and "<script" not in page


def test_prefix_cache_hit_rates_with_their_windows() -> None:
    """Each engine's hit rate says the tokens and the window it covers; no traffic and
    unknown are said, never shown as 0 %; the fleet's (token-weighted) is in the header."""
    plan = _plan()
    plan["engines"][0]["scrape"] = {"prefix_cache": {
        "status": "ok", "rate": 0.75, "source": "counters", "queries_tokens": 512.0,
        "hits_tokens": 384.0, "window_s": 60.0, "engines": 1, "reset": False,
    }}  # fmt: skip
    plan["engines"][1]["scrape"] = {"prefix_cache": {"status": "no_traffic", "rate": None}}
    plan["engines"].append({"name": "e2", "scrape": {"prefix_cache": {"status": "unknown"}}})
    plan["engines"].append({"name": "e3", "scrape": {"prefix_cache": {
        "status": "ok", "rate": 0.25, "source": "gauge", "window_s": None,
    }}})  # fmt: skip
    plan["prefix_cache"] = {
        "status": "ok", "rate": 0.6, "source": "counters", "queries_tokens": 612.0,
        "window_s": None, "engines": 2, "reset": True,
    }  # fmt: skip
    page = render_plan_html(plan)
    text = " ".join(_parse(page).text)
    assert "<td>no traffic</td>" in page and "<td>unknown</td>" in page  # cells of their own
    for needle in [
        "75.0% of 512 tokens",
        "(over 60 s)",
        "no traffic",
        "unknown",
        "25.0%",
        "(the engine's own rate)",
        "60.0% of 612 tokens",
        "(since engine start, 2 engines, restarted)",
    ]:
        assert needle in text, needle


def test_escapes_every_string() -> None:
    """A hostile engine name, region, reason, signal name and error never become markup."""
    page = render_plan_html(_plan(), now=1100.0)
    p = _parse(page)  # asserts: no <script>, only known attribute names
    assert "<b>" not in page and "<img" not in page and HOSTILE not in page
    assert html.escape(HOSTILE) in page
    text = "".join(p.text)
    assert HOSTILE in text and "<b>west</b>" in text and "queue<len>=4" in text
    assert "m<1>" in text and "Time limit <reached>" in text
    assert set(p.tags) <= {
        "html",
        "head",
        "meta",
        "title",
        "style",
        "body",
        "h1",
        "h2",
        "dl",
        "dt",
        "dd",
        "span",
        "table",
        "tr",
        "th",
        "td",
        "div",
        "p",
        "a",
    }


def test_missing_optional_fields() -> None:
    """An empty dict, a plan before the first solve, and sparse entries all render."""
    for plan in [
        {},
        {"plan_id": None, "generation": 0, "engines": [{"name": "e"}], "classes": []},
        {
            "engines": [{"name": "e", "capacity_rps": 0.0, "load_rps": None, "health_level": 1}],
            "classes": [{"name": "x"}, "not a dict"],
            "solve": {"status": None},
            "created_at": float("nan"),
        },
    ]:
        page = render_plan_html(plan, refresh_s=None)
        _parse(page)
        assert "http-equiv" not in page and page.rstrip().endswith("</html>")
    assert "No plan solved yet." in render_plan_html({})


def test_renders_a_real_plan_over_http(shm_name: str) -> None:
    """``GET /plan`` on the real app: text/html; charset=utf-8, one row per class and engine."""

    async def main() -> None:
        config = decode_config(_config_toml(shm_name), source="controller.toml")
        app = make_app(config, run_loop=False)  # startup runs one step: a solved plan
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            async with aiohttp.ClientSession() as s:
                async with s.get(f"http://127.0.0.1:{port}/plan") as resp:
                    assert resp.status == 200
                    assert resp.headers["Content-Type"] == "text/html; charset=utf-8"
                    page = await resp.text()
            plan = app[SERVICE].plan_json()
        finally:
            await runner.cleanup()
        assert plan["plan_id"] is not None and len(plan["classes"]) == 6
        _parse(page)
        assert f"fastroute plan {plan['plan_id']}" in page and "Optimal" in page
        assert page.count('<div class="bar">') == 6
        for i in range(4):
            assert f"<td>engine-{i}</td>" in page
        # every engine says why its share is what it is, in JSON and on the page
        whys = [e["why"] for e in plan["engines"]]
        assert all(isinstance(w, str) and w for w in whys)
        for w in whys:
            assert f"<td>{html.escape(w)}</td>" in page
        # nothing scraped (the engines' URLs do not answer): unknown, per engine and fleet
        assert plan["prefix_cache"]["status"] == "unknown"
        assert [e["scrape"]["prefix_cache"]["status"] for e in plan["engines"]] == ["unknown"] * 4
        assert page.count("<td>unknown</td>") == 4

    asyncio.run(asyncio.wait_for(main(), 20.0))


def test_tenants_admitted_and_shed_are_shown_and_escaped() -> None:
    """The per-tenant section lists demand, admitted and shed; absent without tenants."""
    plan = {
        "tenants": [
            {
                "tenant": "<a>",
                "priority": "default",
                "weight": 2.0,
                "demand_rps": 10.0,
                "admitted_rps": 6.0,
                "shed_rps": 4.0,
                "shed_fraction": 0.4,
            }
        ]
    }
    html = render_plan_html(plan, refresh_s=None)
    assert "<h2>Tenants</h2>" in html
    assert "&lt;a&gt;" in html and "<a>" not in html
    assert "6 rps" in html and "40.0%" in html
    assert "<h2>Tenants</h2>" not in render_plan_html({}, refresh_s=None)


def test_plan_page_shows_the_election_role_epoch_and_leaders_seen() -> None:
    plan = {
        "ha": {
            "role": "follower",
            "epoch": 7,
            "leader": "http://c1<x>",
            "history": [
                {"epoch": 3, "url": "http://c0", "seen_at": 1.7e9},
                {"epoch": 7, "url": "http://c1<x>", "seen_at": 1.7e9 + 60},
            ],
        }
    }
    page = render_plan_html(plan)
    assert "follower / 7" in page
    assert "http://c1&lt;x&gt;" in page and "<x>" not in page
    assert page.index("7 http://c1") < page.index("3 http://c0")  # newest first
    assert "role / epoch" not in render_plan_html({})  # one controller: no election rows
