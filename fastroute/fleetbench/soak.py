"""The soak run's resource samples and their leak test (``fastroute bench chaos --soak``).

Every ``interval_s`` the sampler reads, for each process of the run (the proxy's supervisor and
each of its workers, the controller, each engine): its resident set size and open file
descriptors from ``/proc``, and — for the proxy and the controller — the event loop's task count
from their ``/metrics`` (``fastroute_proxy_asyncio_tasks``: the worker that answers;
``fastroute_controller_asyncio_tasks``). A process restarted by a fault is a new series (its pid).

The leak test fits a least-squares line to each series that spans at least
:data:`MIN_SPAN_FRACTION` of the run, after dropping its first :data:`WARMUP_FRACTION` (caches,
pools and the allocator fill up at the start, which is growth but not a leak). A series leaks
when its slope's 95 % interval lies above zero *and* the fitted growth over the series is at least
:data:`MIN_GROWTH_FRACTION` of its mean: the second condition keeps a statistically clean but
immaterial drift (a few kB of RSS over 30 minutes) from being called a leak. The slope, its
interval and the growth are reported for every series either way.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

__all__ = [
    "MIN_GROWTH_FRACTION",
    "ResourceSample",
    "fit_slope",
    "leak_report",
    "proc_resources",
    "sample_forever",
]

#: Share of a series dropped at its start before the fit: bounded caches fill first (the
#: proxy's decision-record ring holds 4096 requests per worker, full after 8.5 minutes at
#: 8 req/s per worker), and growth up to a bound is not a leak. A 30-minute soak fits the
#: last 15 minutes.
WARMUP_FRACTION = 0.5
#: A series must cover this share of the run to be fitted (restarted processes are short).
MIN_SPAN_FRACTION = 0.5
#: Fitted growth over the series, relative to its mean, below which a slope is immaterial.
MIN_GROWTH_FRACTION = 0.05
#: Two-sided 95 % normal quantile (the series have tens to hundreds of points).
Z_95 = 1.96


@dataclass(frozen=True)
class ResourceSample:
    """One reading: ``value`` of ``resource`` for process ``role``/``pid`` at ``t_s``."""

    t_s: float
    role: str
    pid: int
    resource: str
    value: float


def proc_resources(pid: int) -> dict[str, float] | None:
    """RSS (bytes) and open file descriptors of ``pid``; None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return {"rss_bytes": float(line.split()[1]) * 1024.0, "open_fds": float(fds)}
    return None


async def _gauge(http: aiohttp.ClientSession, url: str, name: str) -> float | None:
    """The sum of ``name``'s samples (any labels) on ``url``'s ``/metrics``; None if absent."""
    try:
        async with http.get(url + "/metrics") as resp:
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((name + " ", name + "{"))
    ]
    values = [v for v in values if not math.isnan(v)]
    return sum(values) if values else None


async def sample_forever(
    processes: Callable[[], Iterable[tuple[str, int]]],
    task_gauges: Callable[[], Iterable[tuple[str, int, str, str]]],
    out: list[ResourceSample],
    t0: float,
    interval_s: float = 10.0,
) -> None:
    """Append samples to ``out`` every ``interval_s`` until cancelled.

    Parameters
    ----------
    processes : callable
        The (role, pid) pairs alive now (called at each sample, so restarts are followed).
    task_gauges : callable
        The gauges to read from ``/metrics`` now, as (role, pid, url, metric): an event loop's
        task count, a queue length. The sample's resource is the metric's name; pid 0 when the
        answering process is not known (a worker behind a shared port).
    """
    timeout = aiohttp.ClientTimeout(total=5.0)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        while True:
            t = time.monotonic() - t0
            for role, pid in processes():
                for resource, value in (proc_resources(pid) or {}).items():
                    out.append(ResourceSample(t, role, pid, resource, value))
            for role, pid, url, metric in task_gauges():
                value = await _gauge(http, url, metric)
                if value is not None:
                    out.append(ResourceSample(t, role, pid, metric, value))
            await asyncio.sleep(interval_s)


def fit_slope(ts: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope of ``ys`` over ``ts`` and its standard error (0 when exact)."""
    n = len(ts)
    mt, my = sum(ts) / n, sum(ys) / n
    sxx = sum((t - mt) ** 2 for t in ts)
    if n < 3 or sxx == 0.0:
        return 0.0, math.inf
    slope = sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / sxx
    resid = sum((y - my - slope * (t - mt)) ** 2 for t, y in zip(ts, ys, strict=True))
    return slope, math.sqrt(resid / (n - 2) / sxx)


def leak_report(samples: list[ResourceSample], duration_s: float) -> list[dict[str, object]]:
    """One row per fitted series (module docstring): slope per hour, its 95 % interval,
    growth over the series relative to its mean, and whether it is a leak."""
    series: dict[tuple[str, int, str], list[ResourceSample]] = {}
    for s in samples:
        series.setdefault((s.role, s.pid, s.resource), []).append(s)
    rows = []
    for (role, pid, resource), points in sorted(series.items()):
        span = points[-1].t_s - points[0].t_s
        if span < MIN_SPAN_FRACTION * duration_s:
            continue
        kept = points[int(len(points) * WARMUP_FRACTION) :]
        ts, ys = [p.t_s for p in kept], [p.value for p in kept]
        slope, stderr = fit_slope(ts, ys)
        mean = sum(ys) / len(ys)
        growth = slope * (ts[-1] - ts[0]) / mean if mean else 0.0
        separated = slope - Z_95 * stderr > 0.0
        rows.append({
            "role": role, "pid": pid, "resource": resource, "points": len(kept),
            "mean": mean, "slope_per_h": slope * 3600.0, "ci95_per_h": Z_95 * stderr * 3600.0,
            "growth": growth, "leak": separated and growth >= MIN_GROWTH_FRACTION,
        })  # fmt: skip
    return rows


def write_plot(samples: list[ResourceSample], path: Path) -> str:
    """One panel per resource, a line per process series (relative to its first value);
    what was written, or why nothing was (matplotlib is optional)."""
    try:
        import matplotlib  # type: ignore[import-not-found]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found]
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib)"
    resources = sorted({s.resource for s in samples})
    fig, axes = plt.subplots(len(resources), 1, figsize=(9, 2.6 * len(resources)), squeeze=False)
    for ax, resource in zip(axes[:, 0], resources, strict=True):
        series: dict[tuple[str, int], list[ResourceSample]] = {}
        for s in samples:
            if s.resource == resource:
                series.setdefault((s.role, s.pid), []).append(s)
        for (role, pid), points in sorted(series.items()):
            base = points[0].value or 1.0
            label = f"{role} {pid}" if pid else role
            ax.plot([p.t_s / 60 for p in points], [p.value / base for p in points], label=label)
        ax.set_title(f"{resource} (relative to each series' first sample)")
        ax.set_xlabel("minutes")
        ax.legend(fontsize=6, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return f"written: {path}"
