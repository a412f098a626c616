"""The human-readable plan page (``GET /plan``): one self-contained HTML document.

:func:`render_plan_html` is a pure function of the dict ``GET /v1/plan`` returns
(:meth:`controller.service.ControllerService.plan_json`): no external assets, no script, inline
CSS, an optional ``<meta http-equiv="refresh">``. Every string from the plan is escaped with
:func:`html.escape`; numbers are formatted, never interpolated raw. Every field except the top-level
shape is optional, so older or newer plan dicts render (missing values show as "—").

Fields rendered when present (besides those ``plan_json`` fills today):

* per engine ``region``, ``hardware``; ``health_level`` (health factor, or a label),
  ``health_reason``, ``health_since`` (epoch s; shown as an age), ``unavailable``,
  ``effective_capacity_rps``; ``why`` (one line: why its share is what it is,
  :mod:`controller.why`); ``signals`` (a flat ``{name: value}`` dict) with ``signals_at``
  (epoch s) or ``signals_age_s``; ``scrape.prefix_cache`` (the engine's prefix-cache window).
* top-level ``prefix_cache``: the fleet's token-weighted prefix-cache hit rate and its window.
"""

from __future__ import annotations

import datetime as dt
import math
import numbers
from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

__all__ = ["render_plan_html"]

MISSING = "—"

_CSS = """
body{font:13px/1.4 system-ui,sans-serif;margin:1em 2em;color:#222}
h1{font-size:18px;margin:0 0 .4em}h2{font-size:15px;margin:1.2em 0 .4em}
table{border-collapse:collapse;margin-bottom:.5em}
th,td{border-bottom:1px solid #ddd;padding:2px 8px;text-align:left;vertical-align:top}
th{background:#f4f4f4;font-weight:600}td.n{text-align:right;font-variant-numeric:tabular-nums}
dl{display:grid;grid-template-columns:max-content auto;gap:0 12px;margin:0}dt{font-weight:600}
dd{margin:0}.bar{display:flex;width:240px;height:12px;background:#eee;border:1px solid #ccc}
.bar span{display:block;height:100%}.bar .shed{background:#c62828}
.legend{font-size:11px;color:#555}.err{color:#b71c1c;font-weight:600}
.h-ok{color:#2e7d32}.h-warn{color:#ef6c00}.h-bad{color:#c62828;font-weight:600}
"""

#: health level (lower-cased) → CSS class; anything else renders unstyled.
_HEALTH_CLASS = {
    "ok": "h-ok",
    "healthy": "h-ok",
    "1": "h-ok",
    "degraded": "h-warn",
    "suspect": "h-warn",
    "warn": "h-warn",
    "ejected": "h-bad",
    "down": "h-bad",
    "failed": "h-bad",
    "0": "h-bad",
}


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    v = float(value)
    return v if math.isfinite(v) else None


def _fmt(value: Any, spec: str = ".3g", scale: float = 1.0, unit: str = "") -> str:
    """Escaped text for ``value``: formatted numbers, escaped strings, "—" for missing."""
    if value is None:
        return MISSING
    if isinstance(value, bool):
        return "yes" if value else "no"
    v = _num(value)
    if v is not None:
        v *= scale
        if spec.endswith("d"):
            return escape(f"{int(v)}{unit}" if v.is_integer() else f"{v:.6g}{unit}")
        return escape(f"{v:{spec}}{unit}")
    return escape(str(value))


def _age(seconds: float | None) -> str:
    if seconds is None:
        return MISSING
    s = max(0.0, seconds)
    if s < 120:
        return f"{s:.1f} s ago"
    if s < 7200:
        return f"{s / 60:.1f} min ago"
    return f"{s / 3600:.1f} h ago"


def _stamp(value: Any) -> str:
    v = _num(value)
    if v is None:
        return _fmt(value)
    try:
        return dt.datetime.fromtimestamp(v, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, OSError, ValueError):
        return _fmt(value)


def _since(value: Any, now: float | None) -> float | None:
    v = _num(value)
    return None if v is None or now is None else now - v


def _hue(index: int) -> int:
    return (index * 137) % 360  # golden-angle spread, stable per engine position


def _dict(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> Sequence[Any]:
    return value if isinstance(value, list | tuple) else ()


def _share_bar(cls: Mapping[str, Any], hues: Mapping[str, int]) -> str:
    """Stacked bar of the class's demand: one segment per engine, then shed (red)."""
    alloc = {k: _num(v) for k, v in _dict(cls.get("allocation_rps")).items()}
    alloc = {k: v for k, v in alloc.items() if v is not None and v > 0}
    demand = _num(cls.get("demand_rps"))
    shed = _num(cls.get("shed_fraction")) or 0.0
    shed = min(max(shed, 0.0), 1.0)
    if alloc and demand:
        shares = {k: v / demand for k, v in alloc.items()}
    else:
        weights = {k: _num(v) for k, v in _dict(cls.get("weights")).items()}
        shares = {k: v * (1.0 - shed) for k, v in weights.items() if v is not None and v > 0}
    total = sum(shares.values()) + shed
    if total > 1.0:  # rounding: never overflow the bar
        shares = {k: v / total for k, v in shares.items()}
        shed /= total
    segs = []
    legend = []
    for name, share in sorted(shares.items(), key=lambda kv: -kv[1]):
        hue = hues.get(name, _hue(len(hues) + len(segs)))
        label = escape(f"{name}: {share:.1%}")
        segs.append(
            f'<span style="width:{100 * share:.2f}%;background:hsl({hue},55%,55%)" '
            f'title="{label}"></span>'
        )
        legend.append(label)
    if shed > 0:
        label = escape(f"shed: {shed:.1%}")
        segs.append(f'<span class="shed" style="width:{100 * shed:.2f}%" title="{label}"></span>')
        legend.append(label)
    return f'<div class="bar">{"".join(segs)}</div><div class="legend">{", ".join(legend)}</div>'


def _prefix_cache(hit: Mapping[str, Any]) -> str:
    """A prefix-cache window (:meth:`fastroute.signals.prefix_cache.PrefixHitRate.as_json`):
    the rate, the tokens it weighs and the window it covers; "no traffic" and "unknown" said."""
    status = hit.get("status")
    if status == "no_traffic":
        return "no traffic"
    rate = _num(hit.get("rate"))
    if status != "ok" or rate is None:
        return MISSING if status is None else "unknown"
    text = _fmt(rate, ".1%")
    queried = _num(hit.get("queries_tokens"))
    if queried is not None:
        text += f" of {_fmt(queried, 'd')} tokens"
    window = _num(hit.get("window_s"))
    if hit.get("source") == "gauge":
        where = "the engine's own rate"
    else:
        where = "since engine start" if window is None else f"over {_fmt(window, '.3g')} s"
    engines = _num(hit.get("engines"))
    if engines is not None and engines > 1:
        where += f", {_fmt(engines, 'd')} engines"
    if hit.get("reset"):
        where += ", restarted"
    return f'{text} <span class="legend">({where})</span>'


def _header(plan: Mapping[str, Any]) -> str:
    solve = _dict(plan.get("solve"))
    rows = [
        ("plan id", _fmt(plan.get("plan_id"), "d")),
        ("generation", _fmt(plan.get("generation"), "d")),
        ("created", _stamp(plan.get("created_at"))),
        ("solve status", _fmt(solve.get("status"))),
        ("objective", _fmt(solve.get("objective"), ".6g")),
        (
            "solve / build time",
            f"{_fmt(solve.get('solve_time_s'), '.3g', 1e3, ' ms')} / "
            f"{_fmt(solve.get('build_time_s'), '.3g', 1e3, ' ms')}",
        ),
        ("iterations", _fmt(solve.get("iterations"), "d")),
        ("warm start", _fmt(solve.get("warm"))),
        ("period", _fmt(plan.get("period_s"), ".3g", unit=" s")),
        ("periods run", _fmt(plan.get("periods_total"), "d")),
        ("retry ratio", _fmt(plan.get("retry_ratio"), ".3g")),
        ("live workers", _fmt(plan.get("live_workers"), "d")),
        ("prefix-cache hit rate", _prefix_cache(_dict(plan.get("prefix_cache")))),
    ]
    ha = _dict(plan.get("ha"))
    if ha:  # several controllers on etcd: this one's role, the epoch, the leaders seen
        history = [_dict(r) for r in _list(ha.get("history"))]
        seen = ", ".join(
            f"{_fmt(r.get('epoch'), 'd')} {_fmt(r.get('url'))} ({_stamp(r.get('seen_at'))})"
            for r in reversed(history)
        )
        rows += [
            ("role / epoch", f"{_fmt(ha.get('role'))} / {_fmt(ha.get('epoch'), 'd')}"),
            ("leader", _fmt(ha.get("leader"))),
            ("leaders seen (newest first)", seen or "none"),
        ]
    err = plan.get("last_error")
    if err:
        rows.append(("last error", f'<span class="err">{_fmt(err)}</span>'))
    return "<dl>" + "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in rows) + "</dl>"


def _classes(plan: Mapping[str, Any], hues: Mapping[str, int]) -> str:
    classes = [c for c in _list(plan.get("classes")) if isinstance(c, Mapping)]
    if not classes:
        return "<p>No plan solved yet.</p>"
    head = (
        "<tr><th>cluster</th><th>model</th><th>priority</th><th>demand</th><th>source</th>"
        "<th>shed</th><th>marginal latency</th><th>allocation</th></tr>"
    )
    rows = []
    for c in classes:
        measured = c.get("measured")
        source = MISSING if measured is None else ("measured" if measured else "default")
        rows.append(
            f"<tr><td>{_fmt(c.get('cluster'))}</td><td>{_fmt(c.get('model'))}</td>"
            f"<td>{_fmt(c.get('priority'))}</td>"
            f'<td class="n">{_fmt(c.get("demand_rps"), ".3g", unit=" rps")}</td>'
            f"<td>{source}</td>"
            f'<td class="n">{_fmt(c.get("shed_fraction"), ".1%")}</td>'
            f'<td class="n">{_fmt(c.get("marginal_cost_s"), ".4g", 1e3, " ms")}</td>'
            f"<td>{_share_bar(c, hues)}</td></tr>"
        )
    return f"<table>{head}{''.join(rows)}</table>"


def _tenants(plan: Mapping[str, Any]) -> str:
    """Per tenant and priority: demand, admitted and shed (empty without tenant demand)."""
    rows = [t for t in _list(plan.get("tenants")) if isinstance(t, Mapping)]
    if not rows:
        return ""
    head = (
        "<tr><th>tenant</th><th>priority</th><th>weight</th><th>demand</th>"
        "<th>admitted</th><th>shed</th></tr>"
    )
    body = "".join(
        f"<tr><td>{_fmt(t.get('tenant'))}</td><td>{_fmt(t.get('priority'))}</td>"
        f'<td class="n">{_fmt(t.get("weight"))}</td>'
        f'<td class="n">{_fmt(t.get("demand_rps"), ".3g", unit=" rps")}</td>'
        f'<td class="n">{_fmt(t.get("admitted_rps"), ".3g", unit=" rps")}</td>'
        f'<td class="n">{_fmt(t.get("shed_fraction"), ".1%")}</td></tr>'
        for t in rows
    )
    return f"<h2>Tenants</h2><table>{head}{body}</table>"


def _signals(engine: Mapping[str, Any], now: float | None) -> str:
    signals = _dict(engine.get("signals"))
    if not signals:
        return MISSING
    age = _num(engine.get("signals_age_s"))
    if age is None:
        age = _since(engine.get("signals_at"), now)
    items = ", ".join(f"{escape(str(k))}={_fmt(v, '.4g')}" for k, v in signals.items())
    return items + (f' <span class="legend">({_age(age)})</span>' if age is not None else "")


def _engines(plan: Mapping[str, Any], hues: Mapping[str, int], now: float | None) -> str:
    engines = [e for e in _list(plan.get("engines")) if isinstance(e, Mapping)]
    if not engines:
        return "<p>No engines.</p>"
    head = (
        "<tr><th></th><th>engine</th><th>region</th><th>hardware</th><th>group</th>"
        "<th>capacity</th><th>load</th><th>utilisation</th><th>why this share</th>"
        "<th>health</th><th>prefix cache</th><th>last signals</th></tr>"
    )
    rows = []
    for e in engines:
        name = str(e.get("name", ""))
        cap, load = _num(e.get("capacity_rps")), _num(e.get("load_rps"))
        util = load / cap if cap and load is not None else None
        level = e.get("health_level")
        health = MISSING
        if level is not None:
            lv = _num(level)
            if lv is not None:  # health factor h ∈ [0, 1] (controller.health LEVELS)
                css = "h-ok" if lv >= 1 else ("h-bad" if lv <= 0 else "h-warn")
            else:
                css = _HEALTH_CLASS.get(str(level).lower(), "")
            health = f'<span class="{css}">{_fmt(level)}</span>'
            if e.get("health_reason"):
                health += f" — {_fmt(e.get('health_reason'))}"
            since = _since(e.get("health_since"), now)
            if since is not None:
                health += f' <span class="legend">(since {_age(since)})</span>'
        if e.get("unavailable"):
            health += ' <span class="h-bad">unavailable</span>'
        capacity = _fmt(cap, ".3g", unit=" rps")
        eff = _num(e.get("effective_capacity_rps"))
        if eff is not None and eff != cap:
            capacity += f" (effective {_fmt(eff, '.3g')})"
        swatch = (
            f'<span style="display:inline-block;width:10px;height:10px;'
            f'background:hsl({hues.get(name, 0)},55%,55%)"></span>'
        )
        rows.append(
            f"<tr><td>{swatch}</td><td>{_fmt(name)}</td><td>{_fmt(e.get('region'))}</td>"
            f"<td>{_fmt(e.get('hardware'))}</td><td>{_fmt(e.get('group'), 'd')}</td>"
            f'<td class="n">{capacity}</td>'
            f'<td class="n">{_fmt(load, ".3g", unit=" rps")}</td>'
            f'<td class="n">{_fmt(util, ".1%")}</td><td>{_fmt(e.get("why"))}</td>'
            f"<td>{health}</td>"
            f"<td>{_prefix_cache(_dict(_dict(e.get('scrape')).get('prefix_cache')))}</td>"
            f"<td>{_signals(e, now)}</td></tr>"
        )
    return f"<table>{head}{''.join(rows)}</table>"


def render_plan_html(
    plan: Mapping[str, Any], *, now: float | None = None, refresh_s: float | None = 5.0
) -> str:
    """Render a ``GET /v1/plan`` dict as a self-contained HTML page.

    Parameters
    ----------
    plan : mapping
        The dict of :meth:`ControllerService.plan_json`; any field may be missing.
    now : float, optional
        Current epoch seconds, for the ages of ``health_since`` / ``signals_at``; without it
        those ages are not shown (the function reads no clock).
    refresh_s : float, optional
        Adds ``<meta http-equiv="refresh">`` with this period; ``None`` for none.

    Returns
    -------
    str
        The HTML document (UTF-8 text).
    """
    engines = [e for e in _list(plan.get("engines")) if isinstance(e, Mapping)]
    hues = {str(e.get("name", "")): _hue(i) for i, e in enumerate(engines)}
    refresh = ""
    if refresh_s is not None and _num(refresh_s) is not None and refresh_s > 0:
        refresh = f'<meta http-equiv="refresh" content="{max(1, round(refresh_s))}">'
    title = f"fastroute plan {_fmt(plan.get('plan_id'), 'd')}"
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"{refresh}<title>{title}</title><style>{_CSS}</style></head><body>"
        f"<h1>{title}</h1>{_header(plan)}"
        f"<h2>Classes</h2>{_classes(plan, hues)}"
        f"<h2>Engines</h2>{_engines(plan, hues, now)}"
        f"{_tenants(plan)}"
        '<p class="legend">JSON: <a href="/v1/plan">/v1/plan</a></p>'
        "</body></html>\n"
    )
