"""Which ``/metrics`` samples each engine kind writes, and what they mean as signals.

An engine's kind (``engines[].kind`` in the configuration) names its software, so its Prometheus
dialect. :func:`~fastroute.signals.vllm.parse_engine_metrics` reads the text of one kind through
its :class:`MetricDialect`: sample name → :class:`~fastroute.signals.vllm.EngineSignals` field.
When an engine exposes two generations of one metric, the lower priority (the current name) wins.

Per field, the names read (vLLM's older generation after a slash; SGLang; llama.cpp):

* ``num_requests_running``: ``vllm:num_requests_running``; ``sglang:num_running_reqs``;
  ``llamacpp:requests_processing``.
* ``num_requests_waiting``: ``vllm:num_requests_waiting``; ``sglang:num_queue_reqs``;
  ``llamacpp:requests_deferred``.
* ``kv_cache_usage`` (0..1): ``vllm:kv_cache_usage_perc`` / ``vllm:gpu_cache_usage_perc``;
  ``sglang:token_usage``; ``llamacpp:kv_cache_usage_ratio`` (older builds only).
* ``prefix_cache_queries_total``: ``vllm:prefix_cache_queries_total`` /
  ``vllm:gpu_prefix_cache_queries_total``; ``sglang:prompt_tokens_total``.
* ``prefix_cache_hits_total``: ``vllm:prefix_cache_hits_total`` /
  ``vllm:gpu_prefix_cache_hits_total``; ``sglang:cached_tokens_total``.
* ``prefix_cache_hit_rate`` (the engine's own recent rate, 0..1): ``vllm:gpu_prefix_cache_hit_rate``
  (the oldest vLLM); ``sglang:cache_hit_rate``.
* ``generation_tokens_total``: ``vllm:generation_tokens_total``;
  ``sglang:generation_tokens_total``; ``llamacpp:tokens_predicted_total``.
* ``preemptions_total``: ``vllm:num_preemptions_total``; ``sglang:num_retracted_requests_total``.
* ``ttft_s``, ``itl_s``, ``e2e_s`` (histograms): ``vllm:time_to_first_token_seconds``,
  ``vllm:inter_token_latency_seconds`` / ``vllm:time_per_output_token_seconds``,
  ``vllm:e2e_request_latency_seconds``; the same names under ``sglang:``.

llama.cpp's ``llama-server`` writes no histograms and no model label (its series belong to the one
model it serves); ``openai`` is any OpenAI-compatible server whose metrics fastroute does not read
(nothing is scraped). SGLang counts the prompt and cached tokens of *finished* requests, so its
prefix-cache counters lag vLLM's (counted when a request is scheduled).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "ENGINE_KINDS",
    "MetricDialect",
    "VLLM",
    "SGLANG",
    "LLAMACPP",
    "OPENAI",
    "dialect_for",
]


@dataclass(frozen=True, slots=True)
class MetricDialect:
    """The ``/metrics`` names of one engine kind.

    Attributes
    ----------
    kind : str
        The engine kind (``engines[].kind``).
    prefix : str
        Every sample read starts with it (``"vllm:"``); ``""`` for a kind with no metrics.
    scalars : mapping of str to (str, int)
        Gauge or counter sample name → (``EngineSignals`` field, priority; lower wins).
    histograms : mapping of str to (str, int)
        Histogram base name (without ``_bucket``/``_sum``/``_count``) → (field, priority).
    averaged : frozenset of str
        Fields averaged, not summed, over the series of one model (ratios).
    model_labels : tuple of str
        Labels that carry the model name, first found wins (none: the engine's one model, ``""``).
    enable_hint : str
        How an operator turns the engine's ``/metrics`` on (said once when it answers 404).
    """

    kind: str
    prefix: str
    scalars: Mapping[str, tuple[str, int]]
    histograms: Mapping[str, tuple[str, int]]
    averaged: frozenset[str]
    model_labels: tuple[str, ...]
    enable_hint: str

    @property
    def has_metrics(self) -> bool:
        """False for a kind whose ``/metrics`` fastroute does not read."""
        return bool(self.prefix)


_RATIOS = frozenset({"kv_cache_usage", "prefix_cache_hit_rate"})

VLLM = MetricDialect(
    kind="vllm",
    prefix="vllm:",
    scalars={
        "vllm:num_requests_running": ("num_requests_running", 0),
        "vllm:num_requests_waiting": ("num_requests_waiting", 0),
        "vllm:kv_cache_usage_perc": ("kv_cache_usage", 0),
        "vllm:gpu_cache_usage_perc": ("kv_cache_usage", 1),
        "vllm:prefix_cache_queries_total": ("prefix_cache_queries_total", 0),
        "vllm:gpu_prefix_cache_queries_total": ("prefix_cache_queries_total", 1),
        "vllm:prefix_cache_hits_total": ("prefix_cache_hits_total", 0),
        "vllm:gpu_prefix_cache_hits_total": ("prefix_cache_hits_total", 1),
        "vllm:gpu_prefix_cache_hit_rate": ("prefix_cache_hit_rate", 0),
        "vllm:generation_tokens_total": ("generation_tokens_total", 0),
        "vllm:num_preemptions_total": ("preemptions_total", 0),
    },
    histograms={
        "vllm:time_to_first_token_seconds": ("ttft_s", 0),
        "vllm:inter_token_latency_seconds": ("itl_s", 0),
        "vllm:time_per_output_token_seconds": ("itl_s", 1),
        "vllm:e2e_request_latency_seconds": ("e2e_s", 0),
    },
    averaged=_RATIOS,
    model_labels=("model_name",),
    enable_hint="vLLM always serves /metrics: check the engine's url",
)

SGLANG = MetricDialect(
    kind="sglang",
    prefix="sglang:",
    scalars={
        "sglang:num_running_reqs": ("num_requests_running", 0),
        "sglang:num_queue_reqs": ("num_requests_waiting", 0),
        "sglang:token_usage": ("kv_cache_usage", 0),
        "sglang:prompt_tokens_total": ("prefix_cache_queries_total", 0),
        "sglang:cached_tokens_total": ("prefix_cache_hits_total", 0),
        "sglang:cache_hit_rate": ("prefix_cache_hit_rate", 0),
        "sglang:generation_tokens_total": ("generation_tokens_total", 0),
        "sglang:num_retracted_requests_total": ("preemptions_total", 0),
    },
    histograms={
        "sglang:time_to_first_token_seconds": ("ttft_s", 0),
        "sglang:inter_token_latency_seconds": ("itl_s", 0),
        "sglang:time_per_output_token_seconds": ("itl_s", 1),
        "sglang:e2e_request_latency_seconds": ("e2e_s", 0),
    },
    averaged=_RATIOS,
    # SGLang before 0.4 labelled its series `name`
    model_labels=("model_name", "name"),
    enable_hint="start SGLang with --enable-metrics",
)

LLAMACPP = MetricDialect(
    kind="llamacpp",
    prefix="llamacpp:",
    scalars={
        "llamacpp:requests_processing": ("num_requests_running", 0),
        "llamacpp:requests_deferred": ("num_requests_waiting", 0),
        "llamacpp:kv_cache_usage_ratio": ("kv_cache_usage", 0),
        "llamacpp:tokens_predicted_total": ("generation_tokens_total", 0),
    },
    histograms={},
    averaged=_RATIOS,
    model_labels=(),
    enable_hint="start llama-server with --metrics",
)

OPENAI = MetricDialect(
    kind="openai",
    prefix="",
    scalars={},
    histograms={},
    averaged=frozenset(),
    model_labels=(),
    enable_hint="an openai-kind engine has no metrics fastroute reads",
)

_BY_KIND = {d.kind: d for d in (VLLM, SGLANG, LLAMACPP, OPENAI)}
#: The engine kinds, as ``engines[].kind`` spells them.
ENGINE_KINDS: tuple[str, ...] = tuple(_BY_KIND)


def dialect_for(kind: str) -> MetricDialect:
    """The dialect of engine kind ``kind``.

    Raises
    ------
    ValueError
        ``kind`` is not one of :data:`ENGINE_KINDS`.
    """
    try:
        return _BY_KIND[kind]
    except KeyError:
        raise ValueError(f"unknown engine kind {kind!r}; expected one of {ENGINE_KINDS}") from None
