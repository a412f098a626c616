"""The relay's pieces in isolation: engine error scrubbing and the stream tally."""

from __future__ import annotations

from fastroute.config import decode_config
from fastroute.proxy.path.fleet import Fleet
from fastroute.proxy.path.relay import _StreamTally, scrub_error
from fastroute.proxy.path.sse import StreamMeter

_CONFIG = '[[engines]]\nname = "e0"\nurl = "http://10.1.2.3:9000"\nmodels = ["m"]\n'


def test_an_engine_error_keeps_its_fields_but_not_the_engines_address() -> None:
    fleet = Fleet(decode_config(_CONFIG))
    body = (
        b'{"error": {"message": "http://10.1.2.3:9000 and 10.1.2.3:9000 said no",'
        b' "type": "invalid_request_error", "param": "n", "code": 7}}'
    )
    message, etype, param, code = scrub_error(fleet, body, "e0", 400)
    assert message == "<e0> and <e0> said no"
    assert (etype, param, code) == ("invalid_request_error", "n", 7)  # an integer code stays
    fallback = scrub_error(fleet, b"not json", "e0", 422)
    assert fallback == ("Engine e0 rejected the request (HTTP 422).", None, None, None)


def test_a_flat_sglang_error_keeps_its_message_and_integer_code() -> None:
    fleet = Fleet(decode_config(_CONFIG))
    body = (
        b'{"object": "error", "message": "bad top_p from 10.1.2.3:9000",'
        b' "type": "BadRequestError", "param": "top_p", "code": 400}'
    )
    assert scrub_error(fleet, body, "e0", 400) == (
        "bad top_p from <e0>",
        "BadRequestError",
        "top_p",
        400,
    )
    no_message = scrub_error(fleet, b'{"object": "error", "code": 400}', "e0", 400)
    assert no_message == ("Engine e0 rejected the request (HTTP 400).", None, None, 400)


class _Tracked:
    def __init__(self) -> None:
        self.tokens_at: list[tuple[int, float]] = []

    def tokens(self, events: int, now_s: float) -> None:
        self.tokens_at.append((events, now_s))


def test_the_tally_measures_reads_and_tells_the_tracker_and_the_first_token() -> None:
    tracked = _Tracked()
    firsts: list[float] = []
    tally = _StreamTally(StreamMeter(strip_usage=True), tracked, firsts.append)  # type: ignore[arg-type]
    role = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
    assert tally.add(role, 0.5) == role
    first = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
    assert tally.add(first, 1.0) == first
    tail = b'data: {"choices":[],"usage":{"completion_tokens":2}}\n\ndata: [DONE]\n\n'
    assert tally.add(tail, 2.5) == b"data: [DONE]\n\n"  # the usage event is stripped
    assert tally.n_chunks == 3 and tally.last == b"data: [DONE]\n\n"
    assert tally.meter.token_events == 1 and tally.meter.tokens == 2
    assert firsts == [1.0]  # TTFT at the first token, not the role event
    assert tracked.tokens_at == [(1, 1.0)]


class _Keep:
    """The parts of a Migration the drain check reads."""

    cut = False
    intact = True


def test_the_drain_check_compares_per_chunk_and_acts_once() -> None:
    tally = _StreamTally(StreamMeter(strip_usage=False), None, lambda now: None)
    calls: list[int] = []
    handoff_at = [10.0]
    tally.keep = _Keep()  # type: ignore[assignment]
    tally.handoff_at, tally.index = handoff_at, 0
    tally.on_drain = lambda: calls.append(1) is None
    assert not tally.draining(9.0, False)  # before the engine's hand-off time
    assert not tally.draining(11.0, True)  # the body ends in this read: nothing to move
    assert tally.draining(11.0, False) and tally.handed_off and calls == [1]
    assert tally.handoff_at is None  # decided: never checked again
    assert not tally.draining(12.0, False) and calls == [1]


def test_a_stream_with_an_error_held_back_or_over_its_bound_is_not_handed_off() -> None:
    for keep in (
        type("Cut", (_Keep,), {"cut": True})(),
        type("Over", (_Keep,), {"intact": False})(),
    ):
        tally = _StreamTally(StreamMeter(strip_usage=False), None, lambda now: None)
        tally.keep = keep  # type: ignore[assignment]
        tally.handoff_at, tally.on_drain = [0.0], lambda: True
        assert not tally.draining(1.0, False) and not tally.handed_off


_FLEET = "".join(
    f'[[engines]]\nname = "e{i}"\nurl = "http://127.0.0.1:{9000 + i}"\nmodels = ["m"]\n\n'
    for i in range(2)
)
_CHAT = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":9,"stream":true}'


class _Resp:
    closed = False

    def close(self) -> None:
        self.closed = True


def test_a_hand_off_prepares_the_continuation_unless_the_output_already_finished() -> None:
    from fastroute.proxy.path.decisions import Attempt, DecisionRecord
    from fastroute.proxy.path.forward import Forwarder
    from fastroute.proxy.path.headers import HeaderRelay
    from fastroute.proxy.path.migration import Migration
    from fastroute.proxy.path.request_state import RequestState
    from fastroute.proxy.proxy_app import build_context

    ctx = build_context(decode_config(_FLEET), None, None)
    relay = Forwarder(ctx, HeaderRelay(False)).relay
    record = DecisionRecord(request_id="r", endpoint="/v1/chat/completions")
    state = RequestState(None, "chat", _CHAT, None, record, None, 0.0)  # type: ignore[arg-type]
    state.fleet = ctx.fleet
    migration = state.migration = Migration(_CHAT, 1 << 20, ranked=(0, 1))
    tally = _StreamTally(StreamMeter(strip_usage=False), None, lambda now: None, migration)
    event = b'data: {"id":"c1","created":1,"choices":[{"index":0,"delta":{"content":"a"}'
    for finish in (b',"finish_reason":"stop"}]}\n\n', b',"finish_reason": "length"}]}\n\n'):
        resp = _Resp()
        tally.add(event + finish, 1.0)
        assert not relay._hand_off(state, resp, Attempt("e0", 0), tally)  # type: ignore[arg-type]
        assert not resp.closed and migration.handoff is None
    migration.kept = [event + b',"finish_reason":null}]}\n\n']
    tally.last = migration.kept[0]
    resp = _Resp()
    assert relay._hand_off(state, resp, Attempt("e0", 0), tally)  # type: ignore[arg-type]
    assert resp.closed and migration.handoff is not None
    body = migration.handoff[0]
    assert b'"continue_final_message":true' in body and b'"content":"a"' in body
    ctx.fleet.leaving({"e0"})  # e1 drains too: nowhere to go, the stream stays
    migration.handoff = None
    assert not relay._hand_off(state, _Resp(), Attempt("e0", 0), tally)  # type: ignore[arg-type]
    assert "no other ranked engine" in (record.not_migrated or "")
