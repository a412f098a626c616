"""The controller and the proxy in front of the two real vLLM engines: what they show of the
engines (fresh scrapes, the engines' own prefix-cache counters), and an engine killed mid-stream.

The engine-killing test runs last (``kills_engine``: sorted after every other test of the
session by ``conftest.py``), so the others always have both engines.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import real_harness as rh

from fastroute.signals.vllm import parse_vllm_metrics

pytestmark = [pytest.mark.real, pytest.mark.timeout(rh.READY_TIMEOUT_S + 300)]

PINNED = {"ignore_eos": True}
# Over two CPU KV blocks (128 tokens each) of shared prefix: a repeat hits at least 256 tokens.
LONG_PREFIX = " ".join(["tell me hello world"] * 130)
#: Bound on waiting for a scrape round (or a control period) to show something, seconds.
SHOW_TIMEOUT_S = 30.0


def get(url: str, timeout_s: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return bytes(resp.read())


def samples(url: str) -> dict[str, float]:
    """``name{labels}`` → value of a ``/metrics`` page."""
    out = {}
    for line in get(url + "/metrics").decode().splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def plan(controller: rh.Running) -> dict[str, Any]:
    return json.loads(get(controller.url + "/v1/plan"))


def engine_of(plan_json: dict[str, Any], name: str) -> dict[str, Any]:
    return {e["name"]: e for e in plan_json["engines"]}[name]


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = SHOW_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(0.25)


def post(url: str, body: dict[str, Any], session: str, timeout_s: float = 60.0) -> Any:
    """A JSON POST through the proxy with a session id; returns the open response."""
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "x-session-id": session},
    )
    return urllib.request.urlopen(request, timeout=timeout_s)


def complete(proxy: rh.Running, prompt: str, session: str) -> tuple[str, dict[str, Any]]:
    """A 2-token completion through the proxy: ``(engine that served it, usage)``."""
    body = {"model": rh.MODEL, "prompt": prompt, "max_tokens": 2, **PINNED}
    with post(proxy.url + "/v1/completions", body, session) as resp:
        assert resp.status == 200
        return resp.headers["x-fastroute-engine"], json.loads(resp.read())["usage"]


def test_no_stale_engine_while_both_are_up(
    proxy: rh.Running, controller: rh.Running, vllm_engines: list[rh.Running]
) -> None:
    """Both engines freshly scraped, by the proxy (its ``/metrics``) and by the controller
    (its ``/metrics`` and plan): no stale engine, no error, the load gauges present."""
    names = [f"vllm-{i}" for i in range(len(vllm_engines))]
    fresh_s = 3 * rh.SCRAPE_INTERVAL_S

    def proxy_fresh() -> bool:
        m = samples(proxy.url)
        return all(
            m.get(f'fastroute_proxy_engine_scrape_age_seconds{{engine="{n}"}}', 1e9) < fresh_s
            and f'fastroute_proxy_engine_requests_running{{engine="{n}"}}' in m
            for n in names
        )

    wait_for("the proxy to scrape both engines", proxy_fresh)
    m = samples(proxy.url)
    ages = [m[f'fastroute_proxy_engine_scrape_age_seconds{{engine="{n}"}}'] for n in names]
    assert all(0.0 <= a < fresh_s for a in ages), ages
    assert {k for k in m if k.startswith("fastroute_proxy_engine_scrape_age_seconds")} == {
        f'fastroute_proxy_engine_scrape_age_seconds{{engine="{n}"}}' for n in names
    }  # exactly the configured engines

    def controller_fresh() -> bool:
        c = samples(controller.url)
        return all(
            c.get(f'fastroute_controller_engine_stale{{engine="{n}"}}') == 0.0 for n in names
        )

    wait_for("a control period to see both engines fresh", controller_fresh)
    for name in names:
        scrape = engine_of(plan(controller), name)["scrape"]
        assert not scrape["stale"] and scrape["healthy"] is True and scrape["error"] is None
        assert scrape["age_s"] is not None and scrape["age_s"] < fresh_s
        assert scrape["running"] is not None and scrape["kv_cache_usage"] is not None


def test_shared_prefix_hits_show_on_the_plan_and_the_proxy(
    proxy: rh.Running, controller: rh.Running, vllm_engines: list[rh.Running]
) -> None:
    """Five requests of one session share a 256+-token prefix, so one of the two engines
    serves at least three of them (the policy may split or spill a group, so which engine is
    not asserted): that engine counts the hits itself (``vllm:prefix_cache_hits_total``), and
    the controller's plan (JSON and page) and the proxy's ``/metrics`` show its hit rate > 0
    from those counters, with the window it covers; the fleet figure too."""
    session = f"real-long-prefix-{uuid.uuid4().hex[:8]}"
    by_engine: dict[str, list[dict[str, Any]]] = {}
    for i in range(5):
        engine, usage = complete(proxy, f"{LONG_PREFIX} number {i}", session)
        by_engine.setdefault(engine, []).append(usage)
    name, usages = max(by_engine.items(), key=lambda kv: len(kv[1]))
    assert len(usages) >= 3, by_engine  # two engines, five requests
    assert usages[0]["prompt_tokens"] > 256
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages[1:]]
    assert all(c >= 256 for c in cached), cached  # the prefix computed by its first
    # the engine's own counters say so
    engine_url = vllm_engines[int(name.rsplit("-", 1)[1])].url
    own = parse_vllm_metrics(get(engine_url + "/metrics").decode())[rh.MODEL]
    assert own.prefix_cache_hits_total is not None and own.prefix_cache_hits_total >= 512

    def on_plan() -> bool:
        hit = engine_of(plan(controller), name)["scrape"]["prefix_cache"]
        return hit["status"] == "ok" and hit["rate"] > 0

    wait_for(f"the controller's plan to show {name}'s prefix-cache hits", on_plan)
    p = plan(controller)
    hit = engine_of(p, name)["scrape"]["prefix_cache"]
    assert hit["source"] == "counters" and 0.0 < hit["rate"] <= 1.0
    assert hit["hits_tokens"] >= 512 and hit["window_s"] > 0  # this test's hits, windowed
    assert hit["queries_tokens"] > 0 and hit["end_s"] > 1e9
    assert p["prefix_cache"]["status"] == "ok" and p["prefix_cache"]["rate"] > 0
    assert engine_of(p, name)["signals"]["prefix_hit_rate"] == hit["rate"]
    page = get(controller.url + "/plan").decode()
    assert "prefix-cache hit rate" in page and " tokens <span" in page

    def on_controller_metrics() -> bool:
        c = samples(controller.url)
        key = f'fastroute_controller_engine_prefix_cache_hit_ratio{{engine="{name}"}}'
        return c.get(key, 0.0) > 0 and c.get("fastroute_controller_prefix_cache_hit_ratio", 0) > 0

    wait_for("the controller's /metrics to show the hit ratio", on_controller_metrics)

    key = f'fastroute_proxy_engine_prefix_cache_hit_ratio{{engine="{name}"}}'
    wait_for(
        "the proxy's /metrics to show the hit ratio", lambda: samples(proxy.url).get(key, 0) > 0
    )
    m = samples(proxy.url)
    assert 0.0 < m[key] <= 1.0
    assert m[f'fastroute_proxy_engine_prefix_cache_queried_tokens{{engine="{name}"}}'] > 0
    assert 0.0 < m["fastroute_proxy_prefix_cache_hit_ratio"] <= 1.0
    print(
        f"\n{name}: prompt {usages[0]['prompt_tokens']} tokens, cached {cached}; plan rate "
        f"{hit['rate']:.3f} ({hit['hits_tokens']:g}/{hit['queries_tokens']:g} tokens over "
        f"{hit['window_s']:.1f} s), fleet {p['prefix_cache']['rate']:.3f}; proxy {m[key]:.3f}"
    )


def _read_events(resp: Any, until: Callable[[int], bool] | None = None) -> list[bytes]:
    """The ``data:`` lines of an SSE response, until ``until(n_events)`` or the body's end."""
    events = []
    for raw in resp:
        line = raw.strip()
        if line.startswith(b"data: "):
            events.append(line[6:])
            if until is not None and until(len(events)):
                break
    return events


@pytest.mark.kills_engine
def test_engine_killed_mid_stream(
    proxy: rh.Running, controller: rh.Running, vllm_engines: list[rh.Running]
) -> None:
    """SIGKILL the engine serving a stream: the client's stream is migrated to the other
    engine and completes (one id, one role event, no error, one ``[DONE]``, all the tokens
    asked for; docs/failure-handling.md, "Mid-stream migration"); the proxy counts the
    failure and ejects the engine (two consecutive failures in this tier); the next
    requests of that session succeed on the other engine; the controller sees it stale."""
    if any(e.proc is None for e in vllm_engines):
        pytest.skip("FASTROUTE_REAL_ENGINES: the engines are not this session's to kill")
    session = f"real-kill-{uuid.uuid4().hex[:8]}"
    max_tokens = 600
    body = {
        "model": rh.MODEL,
        "messages": [{"role": "user", "content": "hello world"}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **PINNED,
    }
    with post(proxy.url + "/v1/chat/completions", body, session) as resp:
        assert resp.status == 200
        victim_name = resp.headers["x-fastroute-engine"]
        rid = resp.headers["x-request-id"]
        victim = vllm_engines[int(victim_name.rsplit("-", 1)[1])]
        before = _read_events(resp, until=lambda n: n >= 5)  # streaming for sure
        assert victim.proc is not None
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(timeout=30)
        after = _read_events(resp)
    assert len(before) == 5 and after, "the stream ended without a word"
    assert after[-1] == b"[DONE]" and b"[DONE]" not in before + after[:-1]  # one [DONE]
    events = [json.loads(e) for e in before + after[:-1]]
    assert all("error" not in e for e in events), [e for e in events if "error" in e]
    assert len({e["id"] for e in events}) == 1 and len({e["created"] for e in events}) == 1
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert sum("role" in d for d in deltas) == 1
    assert events[-1]["usage"]["completion_tokens"] == max_tokens  # summed over the segments
    text = "".join(d.get("content") or "" for d in deltas)
    survivor = next(f"vllm-{i}" for i in range(len(vllm_engines)) if f"vllm-{i}" != victim_name)

    time.sleep(0.2)  # the record is complete once the proxy's handler returned
    record = json.loads(get(proxy.url + f"/admin/decisions/{rid}"))
    attempt = record["attempts"][0]
    assert attempt["engine"] == victim_name and attempt["outcome"] != "success", attempt
    segments = record["segments"]
    assert [s["engine"] for s in segments] == [victim_name, survivor], segments
    assert [s["outcome"] for s in segments][1] == "success" and record["status"] == 200
    assert sum(s["tokens"] for s in segments) == max_tokens
    m = samples(proxy.url)
    failures = sum(
        v
        for k, v in m.items()
        if k.startswith("fastroute_proxy_upstream_failures_total{")
        and f'engine="{victim_name}"' in k
    )
    assert failures >= 1, {k: v for k, v in m.items() if "failures" in k}

    ejection = f'fastroute_proxy_ejections_total{{engine="{victim_name}"}}'
    served = []
    for i in range(4):  # the session's engine is dead: each request must still succeed
        engine, usage = complete(proxy, f"after the kill {i}", session)
        served.append(engine)
        assert usage["completion_tokens"] == 2
    assert set(served) == {survivor}, served
    assert samples(proxy.url).get(ejection, 0.0) >= 1.0, "the proxy did not eject the engine"
    print(
        f"\n{victim_name} killed after {len(before)} events; migrated to {survivor} "
        f"after {segments[0]['tokens']} tokens; {len(text)} characters in all"
    )

    def controller_sees_it() -> bool:
        return engine_of(plan(controller), victim_name)["scrape"]["stale"] is True

    wait_for("the controller to see the killed engine stale", controller_sees_it)
    scrape = engine_of(plan(controller), victim_name)["scrape"]
    assert scrape["error"] is not None
    # a stale engine's window no longer counts: the fleet figure is the survivor's alone
    fleet = plan(controller)["prefix_cache"]
    assert fleet["status"] == "unknown" or fleet["engines"] == 1
