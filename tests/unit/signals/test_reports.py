"""The data-plane report: aggregation, msgpack round trip, versioning, size bounds."""

from __future__ import annotations

import msgspec
import pytest

from fastroute.predict import FleetCalibration
from fastroute.signals.histogram import LogHistogram
from fastroute.signals.reports import (
    REPORT_VERSION,
    DemandAggregator,
    ReportError,
    ReportVersionError,
    completion_tokens_of,
    decode_report,
    encode_report,
)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_aggregator_counts_and_drain_resets_the_window() -> None:
    """Observations land in the right class/engine; drain returns them and starts afresh."""
    clock = _Clock()
    agg = DemandAggregator("eu", "w1", clock=clock)
    agg.observe_request(11, 100, 5)
    agg.observe_request(11, 50)
    agg.observe_output(11, 7)
    agg.observe_request(11, 20, shed=True)
    agg.observe_rejected(11)
    agg.observe_request(2**64 - 1, 1)
    agg.observe_attempt(7, True)
    agg.observe_attempt(7, False, "timeout")
    agg.observe_attempt(7, False, "timeout")
    agg.observe_attempt(7, False, "http_5xx")
    for v in (0.1, 0.1, 0.2, 1.0):
        agg.observe_latency(7, ttft_s=v)
    agg.observe_latency(7, tbot_s=0.02)
    clock.now = 1001.0
    r = agg.drain(in_flight={7: 2, 9: 1}, ejected={9: True})
    assert (r.version, r.source_cluster, r.worker_id) == (REPORT_VERSION, "eu", "w1")
    assert (r.window_start_s, r.window_end_s, r.window_s) == (1000.0, 1001.0, 1.0)
    c = {x.class_key: x for x in r.classes}
    assert (c[11].requests, c[11].prompt_tokens, c[11].output_tokens) == (3, 170, 12)
    assert (c[11].sheds, c[11].rejected_429) == (1, 1)
    assert c[2**64 - 1].requests == 1
    e = {x.engine_id: x for x in r.engines}
    assert e[7].attempts == 4 and e[7].failures == {"timeout": 2, "http_5xx": 1}
    assert e[7].ttft is not None and e[7].ttft.count == 4
    assert e[7].ttft.sum_s == pytest.approx(1.4) and e[7].ttft.max_s == 1.0
    assert e[7].ttft.p50_s == pytest.approx(0.1, rel=0.1)
    assert e[7].ttft.p99_s == pytest.approx(1.0, rel=0.1)
    assert e[7].tbot is not None and e[7].tbot.count == 1
    assert (e[7].in_flight, e[7].ejected) == (2, False)
    assert (e[9].ejected, e[9].in_flight, e[9].attempts, e[9].ttft) == (True, 1, 0, None)
    clock.now = 1002.5
    r2 = agg.drain()
    assert (r2.window_start_s, r2.window_end_s) == (1001.0, 1002.5)
    assert r2.classes == [] and r2.engines == [] and r2.dropped == 0


def test_report_round_trips_through_msgpack() -> None:
    """decode_report(encode_report(r)) == r, u64 keys included."""
    agg = DemandAggregator("c", "w")
    agg.observe_request(2**64 - 1, 3, 4)
    agg.observe_attempt(2**63 + 5, False, "connect_error")
    agg.observe_latency(2**63 + 5, 0.25, 0.01)
    r = agg.drain(in_flight={2**63 + 5: 1})
    assert decode_report(encode_report(r)) == r


def test_a_report_carries_a_calibration_only_when_given() -> None:
    """The calibration round-trips; a report of a proxy that predates the field (8 fields)
    still decodes, without one."""
    cal = FleetCalibration()
    cal.observe_prefill("a40", 1, 800, 0, 0.09)
    r = DemandAggregator("c", "w").drain()
    old = msgspec.msgpack.decode(encode_report(r))[:8]
    assert decode_report(msgspec.msgpack.encode(old)) == r and r.calibration is None
    r.calibration = cal.snapshot()
    back = decode_report(encode_report(r))
    assert back.calibration == cal.snapshot() and back.calibration.types["a40"].n_samples == 1

    class OldReport(msgspec.Struct, array_like=True):  # the format before the field
        version: int
        source_cluster: str
        worker_id: str
        window_start_s: float
        window_end_s: float
        classes: list
        engines: list
        dropped: int = 0

    assert msgspec.msgpack.decode(encode_report(r), type=OldReport).worker_id == "w"


def test_report_rejects_other_versions_and_garbage() -> None:
    """Wrong version → ReportVersionError; malformed payloads → ReportError."""
    with pytest.raises(ReportVersionError):
        decode_report(msgspec.msgpack.encode([REPORT_VERSION + 1, "c", "w", 0.0, 1.0, [], []]))
    for bad in (b"", b"\xc1", msgspec.msgpack.encode({"a": 1}), msgspec.msgpack.encode([1, 2])):
        with pytest.raises(ReportError):
            decode_report(bad)
    with pytest.raises(ReportError, match="before it starts"):
        decode_report(msgspec.msgpack.encode([1, "c", "w", 5.0, 1.0, [], []]))


def test_memory_and_size_are_bounded() -> None:
    """Past max_classes/max_engines observations are dropped and counted; sizes stay small."""
    agg = DemandAggregator("c", "w", max_classes=64, max_engines=256)
    for i in range(10_000):
        agg.observe_request(i, 100, 10)
        agg.observe_attempt(i, i % 3 != 0, ["timeout", "http_5xx", f"k{i}"][i % 3])
        agg.observe_latency(i % 1000, 0.05 + (i % 7) * 0.1, 0.02 + (i % 5) * 0.01)
    r = agg.drain()
    assert len(r.classes) == 64 and len(r.engines) == 256
    assert r.dropped > 0
    assert all(len(e.failures) <= 16 for e in r.engines)
    data = encode_report(r)
    # 64 classes + 256 engines with two latency summaries each: well under 64 KiB.
    assert len(data) < 64 * 1024, len(data)
    idle = encode_report(DemandAggregator("c", "w").drain())
    assert len(idle) < 64


def test_log_histogram_quantiles_are_within_the_bucket_error() -> None:
    """Quantiles of a log-bucket histogram are within ±10 % of the exact ones; merge adds."""
    values = [0.001 * 1.01**i for i in range(1000)]
    h = LogHistogram()
    for v in values:
        h.observe(v)
    for q in (0.5, 0.9, 0.99):
        exact = sorted(values)[int(q * len(values)) - 1]
        got = h.quantile(q)
        assert got is not None and got == pytest.approx(exact, rel=0.1)
    other = LogHistogram()
    other.merge_sparse(h.sparse(), h.sum, h.max)
    assert other.counts == h.counts and other.count == h.count
    assert LogHistogram().quantile(0.5) is None
    h.observe(float("nan"))
    h.observe(1e9)
    assert h.count == 1002


def test_completion_tokens_of_reads_usage() -> None:
    """usage.completion_tokens is found in a JSON body without parsing; absent → 0."""
    body = b'{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens": 42,"total_tokens":51}}'
    assert completion_tokens_of(body) == 42
    assert completion_tokens_of(b'{"data":[]}') == 0
    assert completion_tokens_of(b'{"completion_tokens":') == 0


def test_completion_tokens_of_reads_responses_and_messages_usage() -> None:
    """The Responses and Anthropic answers name their output count ``output_tokens``."""
    responses = (
        b'{"id":"resp_1","usage":{"input_tokens":9,"output_tokens":7,'
        b'"output_tokens_details":{"reasoning_tokens":0},"total_tokens":16}}'
    )
    assert completion_tokens_of(responses) == 7
    assert completion_tokens_of(b'{"usage":{"input_tokens":3,"output_tokens":5}}') == 5
