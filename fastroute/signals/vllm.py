"""Parse an engine's Prometheus ``/metrics`` text into :class:`EngineSignals` (docs/design.md §4).

:func:`parse_engine_metrics` reads the dialect of each engine kind (vLLM, SGLang, llama.cpp; the
names and what they mean are in :mod:`fastroute.signals.dialects`); :func:`parse_vllm_metrics` is
its vLLM case (both vLLM metric generations; the current one wins when an engine exposes both).

Series are grouped by their model label (``model_name``; ``""`` when absent). Series of
one model that differ in other labels (vLLM's ``engine`` label under data parallelism,
SGLang's ``tp_rank``) are summed, except the ratios (``kv_cache_usage``,
``prefix_cache_hit_rate``), which are averaged.

A missing metric is ``None``; text with no known metric parses to no signal at all (an empty
dict); malformed text raises :class:`MetricsParseError`. Plain
exposition text (what engines write) is read by :mod:`fastroute.signals.exposition`, with the
result ``prometheus_client``'s parser gives, several times faster; other text by that parser.
Histograms are cumulative since the engine started: :func:`histogram_window`
turns two successive scrapes into one window's count, mean and quantiles.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from fastroute.errors import FastrouteError
from fastroute.signals.dialects import VLLM, MetricDialect, dialect_for
from fastroute.signals.exposition import plain_samples, sample_value

__all__ = [
    "MetricsParseError",
    "CumulativeHistogram",
    "HistogramWindow",
    "EngineSignals",
    "parse_engine_metrics",
    "parse_vllm_metrics",
    "merge_signals",
    "histogram_window",
    "bucket_quantile",
]


class MetricsParseError(FastrouteError, ValueError):
    """The ``/metrics`` text is not valid Prometheus exposition text."""


class CumulativeHistogram(msgspec.Struct, array_like=True, frozen=True):
    """A Prometheus histogram as scraped: cumulative since the engine started.

    Attributes
    ----------
    sum : float
        ``_sum``: total of observed values (seconds for latency histograms).
    count : float
        ``_count``: number of observations.
    buckets : tuple of (float, float)
        ``(le, cumulative count)`` pairs in increasing ``le`` order, ``+Inf`` last
        when the engine exposes it.
    """

    sum: float
    count: float
    buckets: tuple[tuple[float, float], ...]


class HistogramWindow(msgspec.Struct, frozen=True):
    """Observations between two scrapes of one cumulative histogram.

    Attributes
    ----------
    count : float
        Observations in the window.
    sum : float
        Their total.
    buckets : tuple of (float, float)
        ``(le, cumulative count within the window)``.
    reset : bool
        The counters went backwards (engine restart); the window is the newer scrape.
    """

    count: float
    sum: float
    buckets: tuple[tuple[float, float], ...]
    reset: bool = False

    @property
    def mean(self) -> float | None:
        """Mean observed value, or None for an empty window."""
        return self.sum / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """Quantile ``q`` in [0, 1], interpolated as Prometheus' ``histogram_quantile``."""
        return bucket_quantile(q, self.buckets)


class EngineSignals(msgspec.Struct, kw_only=True):
    """What one scrape says about one model on one engine.

    Attributes
    ----------
    model_name : str
        The ``model_name`` label (``""`` if the engine does not label its series).
    num_requests_running : float or None
    num_requests_waiting : float or None
    kv_cache_usage : float or None
        KV-cache usage as a fraction (1 = full).
    prefix_cache_queries_total : float or None
        Queried prompt tokens, cumulative.
    prefix_cache_hits_total : float or None
        Prompt tokens found in the prefix cache, cumulative.
    prefix_cache_hit_rate : float or None
        The engine's own recent prefix-cache hit rate (0..1), for engines that report a rate
        rather than counters (SGLang's ``cache_hit_rate``).
    generation_tokens_total : float or None
        Output tokens generated, cumulative (the decode half of the engine's token work).
    preemptions_total : float or None
        Cumulative preemptions.
    ttft_s : CumulativeHistogram or None
        Time to first token, seconds.
    itl_s : CumulativeHistogram or None
        Inter-token latency (time per output token), seconds.
    e2e_s : CumulativeHistogram or None
        End-to-end request latency, seconds.
    scraped_at_s : float
        Unix time the scrape completed.
    scrape_duration_s : float
        How long the scrape took (request and read), seconds.
    """

    model_name: str = ""
    num_requests_running: float | None = None
    num_requests_waiting: float | None = None
    kv_cache_usage: float | None = None
    prefix_cache_queries_total: float | None = None
    prefix_cache_hits_total: float | None = None
    prefix_cache_hit_rate: float | None = None
    generation_tokens_total: float | None = None
    preemptions_total: float | None = None
    ttft_s: CumulativeHistogram | None = None
    itl_s: CumulativeHistogram | None = None
    e2e_s: CumulativeHistogram | None = None
    scraped_at_s: float = 0.0
    scrape_duration_s: float = 0.0

    @property
    def prefix_cache_hit_ratio(self) -> float | None:
        """Cumulative hits / queries, or None when unknown or no queries yet."""
        q, h = self.prefix_cache_queries_total, self.prefix_cache_hits_total
        if q is None or h is None or q <= 0:
            return None
        return h / q


class _HistAcc:
    __slots__ = ("sum", "count", "buckets")

    def __init__(self) -> None:
        self.sum = 0.0
        self.count = 0.0
        self.buckets: dict[float, float] = {}

    def freeze(self) -> CumulativeHistogram:
        return CumulativeHistogram(
            self.sum, self.count, tuple(sorted(self.buckets.items(), key=lambda kv: kv[0]))
        )


def _samples(text: str, prefix: str) -> Iterator[tuple[str, Mapping[str, str], float]]:
    """``(name, labels, value)`` of the samples whose name starts with ``prefix``, in order.

    Plain text (nearly always) is read by :func:`fastroute.signals.exposition.plain_samples`,
    which yields what the full parser does; anything else goes through ``prometheus_client``
    (which raises on malformed text as the generator is consumed).
    """
    plain = plain_samples(text, prefix)
    if plain is not None:
        for name, labels, value in plain:
            yield name, labels, sample_value(value)
        return
    for family in text_string_to_metric_families(text):
        if family.name.startswith(prefix):
            for sample in family.samples:
                yield sample.name, sample.labels, float(sample.value)


def _model_of(labels: Mapping[str, str], dialect: MetricDialect) -> str:
    for label in dialect.model_labels:
        model = labels.get(label)
        if model is not None:
            return model
    return ""


def parse_engine_metrics(
    text: str,
    kind: str = "vllm",
    *,
    scraped_at_s: float = 0.0,
    scrape_duration_s: float = 0.0,
) -> dict[str, EngineSignals]:
    """Parse the ``/metrics`` text of an engine of kind ``kind`` into signals, one per model.

    Parameters
    ----------
    text : str
        Prometheus text exposition format (0.0.4).
    kind : {"vllm", "sglang", "llamacpp", "openai"}
        The engine's kind: which dialect (:mod:`fastroute.signals.dialects`) to read.
    scraped_at_s, scrape_duration_s : float
        Copied into every result.

    Returns
    -------
    dict of str to EngineSignals
        Keyed by model name (``""`` for an engine without a model label); empty when the text
        has no metric of the dialect at all (always for ``openai``): no signal.

    Raises
    ------
    MetricsParseError
        The text is not valid exposition format (a bad line, a non-numeric value).
    ValueError
        ``kind`` is not an engine kind.
    """
    dialect = dialect_for(kind)
    if not dialect.has_metrics:
        return {}
    # (model, field) -> (priority, summed value, number of series)
    scalars: dict[tuple[str, str], tuple[int, float, int]] = {}
    hists: dict[tuple[str, str], tuple[int, _HistAcc]] = {}
    models: set[str] = set()
    try:
        for name, labels, value in _samples(text, dialect.prefix):
            scalar = dialect.scalars.get(name)
            if scalar is not None:
                model = _model_of(labels, dialect)
                fld, prio = scalar
                models.add(model)
                old = scalars.get((model, fld))
                if old is None or prio < old[0]:
                    scalars[(model, fld)] = (prio, value, 1)
                elif prio == old[0]:
                    scalars[(model, fld)] = (prio, old[1] + value, old[2] + 1)
                continue
            base, _, suffix = name.rpartition("_")
            hist = dialect.histograms.get(base)
            if hist is None or suffix not in ("bucket", "sum", "count"):
                continue
            model = _model_of(labels, dialect)
            fld, prio = hist
            models.add(model)
            cur = hists.get((model, fld))
            if cur is None or prio < cur[0]:
                cur = (prio, _HistAcc())
                hists[(model, fld)] = cur
            elif prio > cur[0]:
                continue
            _add_histogram_sample(cur[1], name, suffix, labels, value)
    except MetricsParseError:
        raise
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise MetricsParseError(f"malformed Prometheus text: {exc}") from None
    out = {
        model: EngineSignals(
            model_name=model, scraped_at_s=scraped_at_s, scrape_duration_s=scrape_duration_s
        )
        for model in sorted(models)
    }
    for (model, fld), (_, total, n) in scalars.items():
        setattr(out[model], fld, total / n if fld in dialect.averaged else total)
    for (model, fld), (_, acc) in hists.items():
        setattr(out[model], fld, acc.freeze())
    return out


def _add_histogram_sample(
    acc: _HistAcc, name: str, suffix: str, labels: Mapping[str, str], value: float
) -> None:
    if suffix == "sum":
        acc.sum += value
    elif suffix == "count":
        acc.count += value
    else:
        le = float(labels.get("le", "nan"))
        if math.isnan(le):
            raise MetricsParseError(f"{name} sample without a valid 'le' label")
        acc.buckets[le] = acc.buckets.get(le, 0.0) + value


def parse_vllm_metrics(
    text: str, *, scraped_at_s: float = 0.0, scrape_duration_s: float = 0.0
) -> dict[str, EngineSignals]:
    """:func:`parse_engine_metrics` of a vLLM engine (and of the emulator's default dialect).

    Returns
    -------
    dict of str to EngineSignals
        Keyed by ``model_name``; empty when the text has no vLLM metric at all.
    """
    return parse_engine_metrics(
        text, VLLM.kind, scraped_at_s=scraped_at_s, scrape_duration_s=scrape_duration_s
    )


def _merge_hist(
    a: CumulativeHistogram | None, b: CumulativeHistogram | None
) -> CumulativeHistogram | None:
    if a is None:
        return b
    if b is None:
        return a
    buckets = dict(a.buckets)
    for le, c in b.buckets:
        buckets[le] = buckets.get(le, 0.0) + c
    return CumulativeHistogram(a.sum + b.sum, a.count + b.count, tuple(sorted(buckets.items())))


def merge_signals(signals: Sequence[EngineSignals], model_name: str = "") -> EngineSignals:
    """One engine-wide :class:`EngineSignals` from its per-model parts.

    Counts, counters and histograms are summed (histograms bucket by bucket); the ratios
    (``kv_cache_usage``, ``prefix_cache_hit_rate``) are averaged over the parts that report them.

    Parameters
    ----------
    signals : sequence of EngineSignals
        Typically ``parse_engine_metrics(text, kind).values()``; at least one.
    model_name : str
        ``model_name`` of the result.

    Raises
    ------
    ValueError
        ``signals`` is empty: no scrape to merge (a result would claim a scrape at time 0).
    """
    if not signals:
        raise ValueError("merge_signals needs at least one EngineSignals")
    out = EngineSignals(model_name=model_name)
    kv: list[float] = []
    hit_rates: list[float] = []
    for s in signals:
        for fld in (
            "num_requests_running",
            "num_requests_waiting",
            "prefix_cache_queries_total",
            "prefix_cache_hits_total",
            "generation_tokens_total",
            "preemptions_total",
        ):
            v = getattr(s, fld)
            if v is not None:
                cur = getattr(out, fld)
                setattr(out, fld, v if cur is None else cur + v)
        if s.kv_cache_usage is not None:
            kv.append(s.kv_cache_usage)
        if s.prefix_cache_hit_rate is not None:
            hit_rates.append(s.prefix_cache_hit_rate)
        out.ttft_s = _merge_hist(out.ttft_s, s.ttft_s)
        out.itl_s = _merge_hist(out.itl_s, s.itl_s)
        out.e2e_s = _merge_hist(out.e2e_s, s.e2e_s)
        out.scraped_at_s = max(out.scraped_at_s, s.scraped_at_s)
        out.scrape_duration_s = max(out.scrape_duration_s, s.scrape_duration_s)
    out.kv_cache_usage = sum(kv) / len(kv) if kv else None
    out.prefix_cache_hit_rate = sum(hit_rates) / len(hit_rates) if hit_rates else None
    return out


def histogram_window(
    previous: CumulativeHistogram | None, current: CumulativeHistogram
) -> HistogramWindow:
    """The observations between two scrapes of the same cumulative histogram.

    Parameters
    ----------
    previous : CumulativeHistogram or None
        The earlier scrape; None means "since the engine started".
    current : CumulativeHistogram
        The later scrape.

    Returns
    -------
    HistogramWindow
        Differences of sum, count and each bucket. If the count went down (the
        engine restarted, its counters reset), the window is ``current`` alone and
        ``reset`` is True. Buckets only one scrape has are treated as 0 in the other.
    """
    if previous is None:
        return HistogramWindow(current.count, current.sum, current.buckets)
    if current.count < previous.count:
        return HistogramWindow(current.count, current.sum, current.buckets, reset=True)
    prev = dict(previous.buckets)
    buckets = tuple((le, max(0.0, c - prev.get(le, 0.0))) for le, c in current.buckets)
    return HistogramWindow(current.count - previous.count, current.sum - previous.sum, buckets)


def bucket_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Quantile ``q`` of cumulative ``(le, count)`` buckets, like PromQL ``histogram_quantile``.

    Linear interpolation inside the bucket holding the rank; the lowest bucket
    interpolates from 0 (latencies are non-negative); a rank in the ``+Inf`` bucket
    returns the largest finite bound.

    Parameters
    ----------
    q : float
        In [0, 1].
    buckets : sequence of (float, float)
        Cumulative counts in increasing ``le`` order.

    Returns
    -------
    float or None
        None when there are no observations (or no buckets).

    Raises
    ------
    ValueError
        ``q`` outside [0, 1].
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    if not buckets:
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    lower_le, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank and count > lower_count:
            if math.isinf(le):
                return lower_le
            frac = (rank - lower_count) / (count - lower_count)
            return lower_le + (le - lower_le) * frac
        if not math.isinf(le):
            lower_le = le
        lower_count = count
    return lower_le
