"""The signal path (docs/design.md §4): engine ``/metrics`` parsing and data-plane reports.

* :mod:`fastroute.signals.vllm`: engine Prometheus text → :class:`EngineSignals`,
  and window math over cumulative histograms;
* :mod:`fastroute.signals.dialects`: the metric names of each engine kind (vLLM, SGLang,
  llama.cpp);
* :mod:`fastroute.signals.reports`: the data plane's per-window :class:`Report`
  (msgpack), and the :class:`DemandAggregator` the request path feeds;
* :mod:`fastroute.signals.prefix_cache`: each engine's prefix-cache hit rate over a window of
  scrapes, and the fleet's (token-weighted);
* :mod:`fastroute.signals.histogram`: the mergeable log-bucket latency histogram;
* :mod:`fastroute.signals.scrape`: scrape rounds over the engines' ``/metrics`` and ``/health``
  (the controller's and the proxy's scrapers); import it from there (it loads ``aiohttp``).

Builds on ``msgspec``, ``prometheus_client``, ``aiohttp`` (``scrape`` only) and
:mod:`fastroute.errors` only, so the controller can import it.
"""

from fastroute.signals.dialects import ENGINE_KINDS, MetricDialect, dialect_for
from fastroute.signals.histogram import LogHistogram
from fastroute.signals.prefix_cache import PrefixHitRate, PrefixHitTracker, fleet_hit_rate
from fastroute.signals.reports import (
    REPORT_VERSION,
    ClassDemand,
    DemandAggregator,
    EngineReport,
    LatencySummary,
    Report,
    ReportError,
    ReportVersionError,
    decode_report,
    encode_report,
)
from fastroute.signals.vllm import (
    CumulativeHistogram,
    EngineSignals,
    HistogramWindow,
    MetricsParseError,
    bucket_quantile,
    histogram_window,
    merge_signals,
    parse_engine_metrics,
    parse_vllm_metrics,
)

__all__ = [
    "ENGINE_KINDS",
    "MetricDialect",
    "dialect_for",
    "LogHistogram",
    "PrefixHitRate",
    "PrefixHitTracker",
    "fleet_hit_rate",
    "REPORT_VERSION",
    "ClassDemand",
    "DemandAggregator",
    "EngineReport",
    "LatencySummary",
    "Report",
    "ReportError",
    "ReportVersionError",
    "decode_report",
    "encode_report",
    "CumulativeHistogram",
    "EngineSignals",
    "HistogramWindow",
    "MetricsParseError",
    "bucket_quantile",
    "histogram_window",
    "merge_signals",
    "parse_engine_metrics",
    "parse_vllm_metrics",
]
