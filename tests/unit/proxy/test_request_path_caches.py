"""The request path's per-request shortcuts behave like the work they replace."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from fastroute.config import decode_config
from fastroute.proxy.decisions import DecisionLog, DecisionRecord
from fastroute.proxy.fleet import Fleet
from fastroute.proxy.handler import new_request_id
from fastroute.proxy.headers import header_lines
from fastroute.proxy.metrics import ProxyMetrics
from fastroute.proxy.outlier import Outcome

_CONFIG = (
    "".join(
        f'[[engines]]\nname = "e{i}"\nurl = "http://127.0.0.1:{9000 + i}"\nmodels = ["m"]\n'
        f'zone = "{"us" if i < 2 else "eu"}"\ncapacity_rps = 10.0\n\n'
        for i in range(3)
    )
    + "[ejection]\nconsecutive_failures = 1\nmax_ejected_fraction = 1.0\n"
    + '[[network.regions]]\nname = "local"\nzone = "us"\n'
    + '[[network.regions]]\nname = "eu-west"\nzone = "eu"\n'
    + "[network.rtt_ms]\nlocal = { eu-west = 80.0 }\n"
)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _fleet() -> tuple[Fleet, _Clock]:
    clock = _Clock()
    return Fleet(decode_config(_CONFIG), clock=clock), clock


def _uncached(fleet: Fleet, row: int, mask: np.ndarray) -> np.ndarray:
    state = fleet.state
    ok = fleet.outlier.available_mask(fleet.clock()).astype(bool)
    return (state.positive[row] & state.available & ok & mask).astype(np.uint8)


def test_request_ids_unique_and_prefixed() -> None:
    """Request ids unique and prefixed."""
    ids = [new_request_id() for _ in range(1000)]
    assert len(set(ids)) == 1000
    assert all(i.startswith("req-") for i in ids)


def test_request_ids_differ_in_another_process() -> None:
    """Request ids differ in another process."""
    code = "from fastroute.proxy.handler import new_request_id; print(new_request_id())"
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert (
        other.startswith("req-") and other.rsplit("-", 1)[0] != new_request_id().rsplit("-", 1)[0]
    )


def test_request_ids_new_prefix_after_fork() -> None:
    """Request ids new prefix after fork."""
    parent = new_request_id().rsplit("-", 1)[0]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.write(w, new_request_id().encode())
        os._exit(0)
    os.close(w)
    child = os.read(r, 200).decode()
    os.waitpid(pid, 0)
    os.close(r)
    assert child.rsplit("-", 1)[0] != parent


def test_eligible_cache_follows_ejections_and_states() -> None:
    """Eligible cache follows ejections and states."""
    fleet, clock = _fleet()
    row = fleet.rows[("m", "default")]
    us = fleet.eligibility.request_mask(frozenset({"us"}), None)
    every = fleet.eligibility.request_mask(frozenset({"us", "eu"}), None)
    for mask in (us, every):
        assert fleet.view(mask).eligible(row).tolist() == _uncached(fleet, row, mask).tolist()
    assert fleet.view(us).eligible(row).tolist() == [1, 1, 0]
    # An ejection takes effect at once...
    assert fleet.outlier.record(0, Outcome.CONNECT_ERROR, clock.now)
    assert fleet.view(us).eligible(row).tolist() == [0, 1, 0]
    assert fleet.view(every).eligible(row).tolist() == [0, 1, 1]
    # ...and so does its end.
    clock.now += 3600.0
    assert fleet.view(us).eligible(row).tolist() == [1, 1, 0]
    # A new state (weights) invalidates the cache too.
    weights = fleet.state.weights.copy()
    weights[row, 1] = 0.0
    fleet.state = fleet._make_state(7, None, weights, None, None, None)
    assert fleet.view(us).eligible(row).tolist() == [1, 0, 0]


def test_ejection_reasons_cached_per_version() -> None:
    """Ejection reasons cached per version."""
    fleet, clock = _fleet()
    assert fleet.eligibility.ejection_reasons() == {}
    fleet.outlier.record(2, Outcome.TIMEOUT, clock.now)
    reasons = fleet.eligibility.ejection_reasons()
    assert list(reasons) == [2] and reasons == fleet.outlier.reasons(clock.now)
    clock.now += 3600.0
    assert fleet.eligibility.ejection_reasons() == {}


def test_filter_headers_cache_gives_same_answer() -> None:
    """Filter headers cache gives same answer."""
    drop = frozenset({"host", "connection"})
    items = [(b"Host", b"x"), (b"X-Fastroute-Zone", b"us"), (b"X-Request-Id", b"a"), (b"A", b"1")]
    verdicts: dict[bytes, bool] = {}
    for _ in range(2):
        assert header_lines(items, drop, verdicts) == [b"A: 1\r\n"]
    assert verdicts == {b"Host": False, b"X-Fastroute-Zone": False, b"X-Request-Id": False,
                        b"A": True}  # fmt: skip


def test_deferred_decision_rendered_on_read() -> None:
    """Deferred decision rendered on read."""
    log = DecisionLog(capacity=2)
    record = DecisionRecord(request_id="r1", endpoint="/v1/completions")
    calls = []

    def render() -> tuple[list[dict[str, object]], list[dict[str, object]]]:
        calls.append(1)
        return [{"engine": "e0"}], [{"engine": "e1", "filter": "weight"}]

    record.defer(render)
    log.add(record)
    assert record.candidates == [] and not calls
    got = log.get("r1")
    assert got is record and record.candidates == [{"engine": "e0"}] and len(calls) == 1
    assert b'"filters":[{"engine":"e1","filter":"weight"}]' in record.to_json()
    assert b"_render" not in record.to_json() and len(calls) == 1


def test_metric_children_cached() -> None:
    """Metric children cached; counted responses reach the exposition at scrape time."""
    metrics = ProxyMetrics(lambda: None)
    for _ in range(3):
        metrics.count_request("chat", "e0", 200)
    metrics.in_flight_count = 2
    text = metrics.render()
    assert b'fastroute_proxy_requests_total{class="chat",engine="e0",status="200"} 3.0' in text
    assert b"fastroute_proxy_in_flight 2.0" in text
    metrics.count_request("chat", "e0", 200)
    assert b'status="200"} 4.0' in metrics.render()  # flushes add, never reset
    assert metrics.e2e_of("chat", "e0").child is metrics.e2e.labels("chat", "e0")
    assert metrics.ttft_of("c", "e") is metrics.ttft_of("c", "e")
