"""The demo's printed summary: one row per engine, then the totals, then where to look."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fastroute.fleetbench.fleet import PlannedEngine
from fastroute.fleetbench.scrape import EngineCounters, ProxyCounters
from fastroute.loadgen.summary import RunSummary

__all__ = ["summary_table", "plan_text", "why_text", "urls_text", "keep_text"]


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1e3:.0f}"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.0f}%"


def summary_table(
    summary: RunSummary,
    engines: Sequence[PlannedEngine],
    engine_counters: Mapping[str, EngineCounters | None],
    proxy_counters: Mapping[str, ProxyCounters | None],
    *,
    fault_note: str | None = None,
) -> str:
    """The per-engine table and the totals as plain text."""
    by_name = {e.engine: e for e in summary.engines}
    header = (
        f"{'engine':<16} {'region':<8} {'model':<11} {'reqs':>5} {'share':>6} "
        f"{'TTFT p50':>9} {'p99':>6} {'TBOT p50':>9} {'p99':>5} {'cache hit':>9}"
    )
    lines = [header, "-" * len(header)]
    for e in engines:
        s = by_name.get(e.name)
        c = engine_counters.get(e.name)
        lines.append(
            f"{e.name:<16} {e.region:<8} {e.model:<11} {s.requests if s else 0:>5} "
            f"{_pct(s.share if s else 0.0):>6} "
            f"{_ms(s.ttft.p50_s if s else None):>9} {_ms(s.ttft.p99_s if s else None):>6} "
            f"{_ms(s.tbot.p50_s if s else None):>9} {_ms(s.tbot.p99_s if s else None):>5} "
            f"{_pct(c.hit_rate if c else None):>9}"
        )
    lines.append("(latencies in ms, measured by the client; cache hit from the engines' /metrics)")
    retries = sum(p.retries for p in proxy_counters.values() if p is not None)
    sheds = sum(p.shed for p in proxy_counters.values() if p is not None)
    cut = summary.errors.get("deadline", 0)
    errors = {k: v for k, v in summary.errors.items() if k != "deadline"}
    err_text = ", ".join(f"{k} {v}" for k, v in errors.items()) or "none"
    lines += [
        "",
        f"requests   {summary.requests} sent, {summary.ok} ok, errors: {err_text}"
        + (f" ({cut} still running at the end, cancelled)" if cut else ""),
        f"latency    TTFT p50 {_ms(summary.ttft.p50_s)} / p99 {_ms(summary.ttft.p99_s)} ms, "
        f"TBOT p50 {_ms(summary.tbot.p50_s)} / p99 {_ms(summary.tbot.p99_s)} ms, "
        f"e2e p50 {_ms(summary.e2e.p50_s)} ms",
        f"goodput    {summary.goodput_rps:.2f} req/s within SLO "
        f"({_pct(summary.slo_attainment)} of requests); "
        f"throughput {summary.throughput_rps:.2f} req/s, "
        f"{summary.output_tokens / summary.wall_s if summary.wall_s else 0:.0f} tokens/s",
        f"proxies    {retries:.0f} retries, {sheds:.0f} requests shed",
    ]
    if fault_note:
        lines.append(f"fault      {fault_note}")
    return "\n".join(lines)


def plan_text(plan: object) -> str:
    """One line on the controller's view: derated engines, or that none is."""
    if not isinstance(plan, dict):
        return "controller plan: unavailable"
    derated = []
    for e in plan.get("engines") or []:
        level = e.get("health_level") if isinstance(e, dict) else None
        if isinstance(level, int | float) and level < 1.0:
            reason = e.get("health_reason") or "anomalous"
            derated.append(f"{e.get('name')} to {level:g} of capacity ({reason})")
    gen = plan.get("generation")
    if derated:
        return f"controller  generation {gen}; derated " + "; ".join(derated)
    return f"controller  generation {gen}; no engine derated"


def why_text(plan: object) -> str:
    """One line per engine: why the controller's plan gives it its share (``engines[].why`` of
    ``/v1/plan``, :mod:`controller.why`); empty when the plan has none."""
    if not isinstance(plan, dict):
        return ""
    rows = [
        (str(e.get("name")), str(e["why"]))
        for e in plan.get("engines") or []
        if isinstance(e, dict) and e.get("why")
    ]
    if not rows:
        return ""
    width = max(len(name) for name, _ in rows)
    return "Why each engine gets its share (controller plan):\n" + "\n".join(
        f"  {name:<{width}}  {why}" for name, why in rows
    )


def urls_text(
    proxy_urls: Mapping[str, str], controller_url: str, engines: Sequence[PlannedEngine]
) -> str:
    """Where to look (printed after the table)."""
    lines = ["Where to look:"]
    for source, url in proxy_urls.items():
        lines.append(f"  proxy {source:<8} {url}/v1/chat/completions   metrics {url}/metrics")
    lines.append(
        f"  controller      {controller_url}/plan (HTML)   {controller_url}/v1/plan (JSON)"
    )
    lines.append(f"                  {controller_url}/metrics")
    if engines:
        lines.append(f"  engine metrics  {engines[0].url}/metrics  (… one port per engine)")
    return "\n".join(lines)


def keep_text(proxy_url: str, model: str, table_name: str) -> str:
    """Snippets to try the running system (``--keep``)."""
    return f"""Everything keeps running; try it from another shell (Ctrl-C here stops it all):

curl -si {proxy_url}/v1/chat/completions -H 'content-type: application/json' \\
  -H 'x-session-id: my-session' \\
  -d '{{"model": "{model}", "max_tokens": 16,
       "messages": [{{"role": "user", "content": "hello"}}]}}'

python - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="{proxy_url}/v1", api_key="unused")
stream = client.chat.completions.create(
    model="{model}", messages=[{{"role": "user", "content": "hello"}}],
    max_tokens=16, stream=True, extra_headers={{"x-session-id": "my-session"}})
for chunk in stream:
    if chunk.choices:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
PY

fastroute table show {table_name}
"""
