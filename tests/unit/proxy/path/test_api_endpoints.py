"""The Responses hooks: a follow-up goes first to the engine that stored its previous
response, only while that engine may serve it; the answered id is recorded."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import numpy as np

from fastroute.config import decode_config
from fastroute.hashing import engine_id
from fastroute.policy import Decision
from fastroute.proxy.http.reply import Reply
from fastroute.proxy.path.api_endpoints import (
    PIN_REASON,
    ResponsesEndpoint,
    pinned_index,
    response_key,
)
from fastroute.proxy.path.api_requests import parse_responses
from fastroute.proxy.path.decisions import Attempt, DecisionRecord
from fastroute.proxy.path.fleet import Fleet
from fastroute.tables.response_map import ResponseMap

_CONFIG = "".join(
    f'[[engines]]\nname = "e{i}"\nurl = "http://127.0.0.1:{9000 + i}"\nmodels = ["{model}"]\n'
    "capacity_rps = 10.0\n\n"
    for i, model in enumerate(["m", "m", "other"])
)
ALL = np.ones(3, dtype=bool)


def _state(fleet: Fleet, previous: str | None) -> SimpleNamespace:
    body = msgspec.json.encode({"model": "m", "input": "hi", "previous_response_id": previous})
    return SimpleNamespace(
        parsed=parse_responses(body),
        fleet=fleet,
        model="m",
        record=DecisionRecord(request_id="r", endpoint="/v1/responses"),
    )


def _decision(fleet: Fleet, ranked: tuple[int, ...]) -> Decision:
    ids = tuple(int(fleet.engine_ids[i]) for i in ranked)
    return Decision(ranked=ranked, engine_ids=ids, policy="p", reason="hrw")


def test_pin_puts_the_storing_engine_first() -> None:
    fleet = Fleet(decode_config(_CONFIG, source="t.toml"))
    responses = ResponseMap.private(capacity=8)
    responses.put(response_key("resp_1"), engine_id("e1"))
    call = ResponsesEndpoint(responses).begin(SimpleNamespace(meter_type=None))
    pinned = call.pin(_state(fleet, "resp_1"), ALL, _decision(fleet, (0, 1)))
    assert pinned.ranked == (1, 0) and pinned.reason == PIN_REASON
    assert pinned.engine_ids == (engine_id("e1"), engine_id("e0"))
    outside = call.pin(_state(fleet, "resp_1"), ALL, _decision(fleet, (0,)))
    assert outside.ranked == (1, 0)  # eligible though the policy ranked it nowhere


def test_pin_routes_normally_when_the_engine_may_not_serve() -> None:
    """Unknown id, no id, an engine out of the zones, another model's engine, an engine no
    longer configured: the policy's decision stands."""
    fleet = Fleet(decode_config(_CONFIG, source="t.toml"))
    responses = ResponseMap.private(capacity=8)
    responses.put(response_key("resp_other"), engine_id("e2"))
    responses.put(response_key("resp_gone"), engine_id("removed"))
    responses.put(response_key("resp_1"), engine_id("e1"))
    call = ResponsesEndpoint(responses).begin(SimpleNamespace(meter_type=None))
    decision = _decision(fleet, (0, 1))
    for previous in ("resp_unknown", None, "resp_other", "resp_gone"):
        assert call.pin(_state(fleet, previous), ALL, decision) is decision
    no_e1 = np.array([True, False, True])
    assert call.pin(_state(fleet, "resp_1"), no_e1, decision) is decision
    assert pinned_index(fleet, engine_id("e1"), "m", ALL) == 1


def test_finish_records_the_answered_id() -> None:
    fleet = Fleet(decode_config(_CONFIG, source="t.toml"))
    responses = ResponseMap.private(capacity=8)
    state = _state(fleet, None)
    state.meter_type = None
    call = ResponsesEndpoint(responses).begin(state)
    state.record.attempts.append(Attempt(engine="e0", rank=0))
    call.finish(state, Reply(200, [], b'{"id":"resp_json","object":"response"}'))
    assert responses.get(response_key("resp_json")) == engine_id("e0")
    meter = state.meter_type(False)
    meter.response_id = "resp_streamed"
    call.finish(state, Reply(200, [], streamed=True))
    assert responses.get(response_key("resp_streamed")) == engine_id("e0")
    call.finish(state, Reply(404, [], b'{"id":"resp_error"}'))
    assert responses.get(response_key("resp_error")) is None
