"""Decision records: deferred parts are rendered only when read."""

from __future__ import annotations

from fastroute.proxy.path.decisions import DecisionLog, DecisionRecord


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
