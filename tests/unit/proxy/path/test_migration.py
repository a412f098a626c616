"""Migration pieces in isolation: why a segment ended."""

from __future__ import annotations

from fastroute.guards.outlier import Outcome
from fastroute.proxy.http.upstream import UpstreamError
from fastroute.proxy.path.migration import DrainHandoff, migration_reason


def test_each_way_a_segment_ends_has_its_reason() -> None:
    assert migration_reason(DrainHandoff("e0")) == "drain"
    assert migration_reason(UpstreamError(Outcome.TIMEOUT, "t")) == "timeout"
    assert migration_reason(UpstreamError(Outcome.HTTP_5XX, "in-stream error")) == "error"
    assert migration_reason(UpstreamError(Outcome.CONNECT_ERROR, "reset")) == "connection"
    assert "draining" in DrainHandoff("e0").message
