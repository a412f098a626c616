"""The relay's pieces in isolation: engine error scrubbing and the stream tally."""

from __future__ import annotations

from fastroute.config import decode_config
from fastroute.proxy.path.fleet import Fleet
from fastroute.proxy.path.relay import _StreamTally, scrub_error

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
        self.chunks: list[tuple[bytes, float]] = []

    def chunk(self, data: bytes, now_s: float) -> None:
        self.chunks.append((data, now_s))


def test_the_tally_counts_chunks_events_and_usage_and_tells_the_tracker() -> None:
    tracked = _Tracked()
    first = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
    tally = _StreamTally(first, tracked)  # type: ignore[arg-type]
    tally.add(first, 1.0)
    tail = b'data: {"choices":[],"usage":{"completion_tokens":2}}\n\ndata: [DONE]\n\n'
    tally.add(tail, 2.5)
    assert (tally.n_chunks, tally.n_events, tally.n_usage) == (2, 3, 1)
    assert tally.first is first and tally.last is tail and tally.last_at == 2.5
    assert tracked.chunks == [(first, 1.0), (tail, 2.5)]
