"""Prometheus metrics of one emulated engine, with vLLM's names, types and buckets.

One :class:`EngineMetrics` per engine, each with its own ``CollectorRegistry``
(several engines share a process). A single collector reads the model's
counters at scrape time, so what ``/metrics`` reports is exactly what the model
did; histograms are kept here (``observe`` is a bisect and two additions, no
lock: everything runs on the event loop thread). Names, label names
(``model_name``, ``engine``) and bucket boundaries follow vLLM's
``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``).

``compat`` picks the generation of names:

* ``"current"``: ``vllm:kv_cache_usage_perc``, ``vllm:inter_token_latency_seconds``;
* ``"legacy"`` (vLLM ≤ 0.8): ``vllm:gpu_cache_usage_perc``,
  ``vllm:time_per_output_token_seconds``;
* ``"both"`` (vLLM 0.9–0.10 exposes both while deprecating the old ones).

``kind`` picks the engine whose dialect to write: ``"vllm"`` (the above), ``"sglang"``
(``sglang:num_running_reqs``, ``num_queue_reqs``, ``token_usage``, ``cache_hit_rate``, the
token counters, the TTFT / inter-token / e2e histograms, labelled ``model_name``) or
``"llamacpp"`` (``llamacpp:requests_processing``, ``requests_deferred``, the token counters: no
histograms, no labels). The ``fastroute_emulator_*`` metrics come with every kind.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from fastroute.emulator.faults import FAULT_KINDS, FaultController
from fastroute.emulator.model import EngineModel

__all__ = [
    "EngineMetrics",
    "Histogram",
    "TTFT_BUCKETS_S",
    "ITL_BUCKETS_S",
    "E2E_BUCKETS_S",
    "COMPAT_CHOICES",
    "KIND_CHOICES",
]

#: vLLM's ``vllm:time_to_first_token_seconds`` buckets.
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
#: vLLM's ``vllm:inter_token_latency_seconds`` (and ``time_per_output_token``) buckets.
ITL_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
#: vLLM's request-latency buckets (``vllm:e2e_request_latency_seconds``, queue time).
E2E_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
COMPAT_CHOICES = ("current", "legacy", "both")
KIND_CHOICES = ("vllm", "sglang", "llamacpp")


class Histogram:
    """A Prometheus histogram without locks (single-threaded use).

    Parameters
    ----------
    bounds : sequence of float
        Upper bounds (``le``), increasing; ``+Inf`` is implicit.
    """

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        """Record one value."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def family(self, name: str, doc: str, labels: Sequence[str], values: Sequence[str]) -> Metric:
        """Export as a ``HistogramMetricFamily`` with cumulative buckets."""
        fam = HistogramMetricFamily(name, doc, labels=list(labels))
        cumulative = 0
        buckets = []
        for bound, n in zip(self.bounds, self.counts, strict=False):
            cumulative += n
            buckets.append((repr(float(bound)), cumulative))
        buckets.append(("+Inf", self.count))
        fam.add_metric(list(values), buckets, self.sum)
        return fam


class EngineMetrics(Collector):
    """The metrics of one engine; :meth:`render` returns the Prometheus text.

    Parameters
    ----------
    model_name : str
        Value of the ``model_name`` label.
    model : EngineModel
        Read at scrape time for gauges and counters.
    faults : FaultController
        Read at scrape time for ``fastroute_emulator_fault_active``.
    compat : {"current", "legacy", "both"}
        Which generation of vLLM metric names to expose.
    kind : {"vllm", "sglang", "llamacpp"}
        Which engine's metric dialect to write.
    info : dict of str to str, optional
        Labels of ``fastroute_emulator_info`` (engine name, profile, role, region).
    """

    def __init__(
        self,
        model_name: str,
        model: EngineModel,
        faults: FaultController,
        *,
        compat: str = "current",
        kind: str = "vllm",
        info: dict[str, str] | None = None,
    ) -> None:
        if compat not in COMPAT_CHOICES:
            raise ValueError(f"compat must be one of {COMPAT_CHOICES}, got {compat!r}")
        if kind not in KIND_CHOICES:
            raise ValueError(f"kind must be one of {KIND_CHOICES}, got {kind!r}")
        self.kind = kind
        self.model_name = model_name
        self.model = model
        self.faults = faults
        self.compat = compat
        self.info = dict(info or {})
        self.ttft = Histogram(TTFT_BUCKETS_S)
        self.itl = Histogram(ITL_BUCKETS_S)
        self.e2e = Histogram(E2E_BUCKETS_S)
        self.queue = Histogram(E2E_BUCKETS_S)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def _shown(self, value: float) -> float:
        """A load gauge as the page shows it: 0 while the ``metrics_lie`` fault claims idle."""
        return 0.0 if self.faults.state.metrics_lie else value

    def render(self) -> bytes:
        """The exposition text (``text/plain; version=0.0.4``)."""
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        """Yield every metric (called by the registry at scrape time)."""
        if self.kind == "sglang":
            yield from self._sglang_metrics()
        elif self.kind == "llamacpp":
            yield from self._llamacpp_metrics()
        else:
            yield from self._vllm_metrics()
        yield from self._emulator_metrics()

    def _sglang_metrics(self) -> Iterator[Metric]:
        m = self.model
        labels, values = ["model_name"], [self.model_name]
        queries = m.prefix_cache_queries_total
        scalars = (
            (GaugeMetricFamily, "sglang:num_running_reqs", "The number of running requests.",
             self._shown(m.num_running)),
            (GaugeMetricFamily, "sglang:num_queue_reqs",
             "The number of requests in the waiting queue.", self._shown(m.num_waiting)),
            (GaugeMetricFamily, "sglang:token_usage", "The token usage.", self._shown(m.kv_usage)),
            (GaugeMetricFamily, "sglang:cache_hit_rate", "The prefix cache hit rate.",
             m.prefix_cache_hits_total / queries if queries else 0.0),
            (CounterMetricFamily, "sglang:prompt_tokens", "Number of prefill tokens processed.",
             m.prompt_tokens_total),
            (CounterMetricFamily, "sglang:generation_tokens",
             "Number of generation tokens processed.", m.generation_tokens_total),
            (CounterMetricFamily, "sglang:cached_tokens", "Number of cached prompt tokens.",
             m.prefix_cache_hits_total),
            (CounterMetricFamily, "sglang:num_retracted_requests",
             "Total number of retracted requests.", m.num_preemptions_total),
        )  # fmt: skip
        for family, name, doc, value in scalars:
            fam = family(name, doc, labels=labels)
            fam.add_metric(values, value)
            yield fam
        for hist, name, doc in (
            (self.ttft, "sglang:time_to_first_token_seconds",
             "Histogram of time to first token in seconds."),
            (self.itl, "sglang:inter_token_latency_seconds",
             "Histogram of inter-token latency in seconds."),
            (self.e2e, "sglang:e2e_request_latency_seconds",
             "Histogram of End-to-end request latency in seconds"),
        ):  # fmt: skip
            yield hist.family(name, doc, labels, values)

    def _llamacpp_metrics(self) -> Iterator[Metric]:
        m = self.model
        for family, name, doc, value in (
            (CounterMetricFamily, "llamacpp:prompt_tokens", "Number of prompt tokens processed.",
             m.prompt_tokens_total),
            (CounterMetricFamily, "llamacpp:tokens_predicted",
             "Number of generation tokens processed.", m.generation_tokens_total),
            (GaugeMetricFamily, "llamacpp:requests_processing", "Number of requests processing.",
             self._shown(m.num_running)),
            (GaugeMetricFamily, "llamacpp:requests_deferred", "Number of requests deferred.",
             self._shown(m.num_waiting)),
        ):  # fmt: skip
            yield family(name, doc, value=value)

    def _vllm_metrics(self) -> Iterator[Metric]:
        m = self.model
        labels = ["model_name", "engine"]
        values = [self.model_name, "0"]
        current = self.compat in ("current", "both")
        legacy = self.compat in ("legacy", "both")

        def gauge(name: str, doc: str, value: float) -> Metric:
            fam = GaugeMetricFamily(name, doc, labels=labels)
            fam.add_metric(values, value)
            return fam

        def counter(name: str, doc: str, value: float) -> Metric:
            fam = CounterMetricFamily(name, doc, labels=labels)
            fam.add_metric(values, value)
            return fam

        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            self._shown(m.num_running),
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            self._shown(m.num_waiting),
        )
        if current:
            yield gauge(
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                self._shown(m.kv_usage),
            )
        if legacy:
            yield gauge(
                "vllm:gpu_cache_usage_perc",
                "GPU KV-cache usage. 1 means 100 percent usage.",
                self._shown(m.kv_usage),
            )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            m.prefix_cache_queries_total,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            m.prefix_cache_hits_total,
        )
        yield counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            m.num_preemptions_total,
        )
        yield counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", m.prompt_tokens_total
        )
        yield counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            m.generation_tokens_total,
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*labels, "finished_reason"],
        )
        for reason, n in sorted(m.finished_total.items()):
            success.add_metric([*values, reason], n)
        yield success
        yield self.ttft.family(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            values,
        )
        if current:
            yield self.itl.family(
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                labels,
                values,
            )
        if legacy:
            yield self.itl.family(
                "vllm:time_per_output_token_seconds",
                "Histogram of time per output token in seconds.",
                labels,
                values,
            )
        yield self.e2e.family(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            labels,
            values,
        )
        yield self.queue.family(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            labels,
            values,
        )

    def _emulator_metrics(self) -> Iterator[Metric]:
        active = self.faults.state.active()
        fam = GaugeMetricFamily(
            "fastroute_emulator_fault_active",
            "1 while the fault kind is injected.",
            labels=["kind"],
        )
        for kind in FAULT_KINDS:
            fam.add_metric([kind], 1.0 if active[kind] else 0.0)
        yield fam
        injected = CounterMetricFamily(
            "fastroute_emulator_faults_injected",
            "Requests failed on purpose, by fault kind.",
            labels=["kind"],
        )
        for kind, n in sorted(self.faults.injected_total.items()):
            injected.add_metric([kind], n)
        yield injected
        yield GaugeMetricFamily(
            "fastroute_emulator_slowdown",
            "Step-time multiplier in force.",
            value=self.model.slowdown,
        )
        if self.info:
            keys = sorted(self.info)
            fam = GaugeMetricFamily(
                "fastroute_emulator_info", "The emulated engine's identity.", labels=keys
            )
            fam.add_metric([self.info[k] for k in keys], 1.0)
            yield fam
