"""The P/D stage bodies: what the prefill engine is sent, and the usage the client sees."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec

from fastroute.proxy.path.pd import PREFILL_PARAMS, decode_body, prefill_body
from fastroute.proxy.path.pd_usage import (
    CachedTokensSink,
    prefill_cached_tokens,
    with_prefill_cached,
)

_REQUEST = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 50,
    "max_completion_tokens": 50,
    "min_tokens": 4,
    "min_completion_tokens": 4,
    "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    "n": 3,
    "best_of": 3,
    "logprobs": True,
    "top_logprobs": 2,
    "stop": ["\n"],
    "temperature": 0.5,
}


def test_the_prefill_body_has_nothing_a_one_token_answer_conflicts_with() -> None:
    body = msgspec.json.decode(prefill_body(_REQUEST))
    assert body == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "stream": False,
        "n": 1,
        "logprobs": True,
        "top_logprobs": 2,
        "stop": ["\n"],
        "temperature": 0.5,
        "kv_transfer_params": PREFILL_PARAMS,
    }
    minimal = msgspec.json.decode(prefill_body({"model": "m", "prompt": "x"}))
    assert minimal == {
        "model": "m",
        "prompt": "x",
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": PREFILL_PARAMS,
    }


def test_the_decode_body_keeps_every_field_of_the_client() -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [1]}
    body = msgspec.json.decode(decode_body(_REQUEST, params))
    assert body == {**_REQUEST, "kv_transfer_params": params}


def _usage(cached: int | None) -> dict[str, object]:
    details = None if cached is None else {"cached_tokens": cached}
    return {"prompt_tokens": 9, "completion_tokens": 2, "prompt_tokens_details": details}


def test_the_prefill_answers_cached_tokens_are_read() -> None:
    assert prefill_cached_tokens(msgspec.json.encode({"usage": _usage(3)})) == 3
    assert prefill_cached_tokens(msgspec.json.encode({"usage": _usage(None)})) is None
    assert prefill_cached_tokens(b'{"usage": {"prompt_tokens": 9}}') is None
    assert prefill_cached_tokens(b"not json") is None


def test_a_decode_json_answer_gets_the_prefills_cached_tokens_or_none() -> None:
    decoded = msgspec.json.encode({"id": "x", "usage": _usage(9)})
    got = msgspec.json.decode(with_prefill_cached(decoded, 0))
    assert got == {"id": "x", "usage": _usage(0)}
    got = msgspec.json.decode(with_prefill_cached(decoded, None))
    assert got == {"id": "x", "usage": _usage(None)}  # the decode engine's 9 is gone
    no_details = msgspec.json.encode({"usage": _usage(None)})
    assert msgspec.json.decode(with_prefill_cached(no_details, 5)) == {"usage": _usage(5)}
    assert with_prefill_cached(no_details, None) is no_details
    assert with_prefill_cached(b'{"choices": []}', 5) == b'{"choices": []}'
    kept = {"usage": {**_usage(9), "prompt_tokens_details": {"cached_tokens": 9, "x": 1}}}
    got = msgspec.json.decode(with_prefill_cached(msgspec.json.encode(kept), None))
    assert got["usage"]["prompt_tokens_details"] == {"x": 1}


class _Recorder:
    """A client sink (and splice) recording what reached the client."""

    def __init__(self, splice: bool) -> None:
        self.chunks: list[bytes] = []
        self.ended = False
        self.has_splice = splice
        self.callback: Callable[[], None] | None = None

    async def start(self, status: int, headers: object, raw_head: bytes = b"") -> None:
        self.status = status

    async def write(self, data: bytes) -> None:
        assert data
        self.chunks.append(data)

    async def end(self) -> None:
        self.ended = True

    def splice(self) -> _Recorder | None:
        return self if self.has_splice else None

    def write_now(self, data: bytes, last: bool = False) -> bool:
        assert data
        self.chunks.append(data)
        self.ended = self.ended or last
        return True

    def on_writable(self, callback: Callable[[], None] | None) -> None:
        self.callback = callback


def _event(obj: object) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


_TOKEN = _event({"choices": [{"delta": {"content": "a"}}]})
_USAGE = _event({"choices": [], "usage": _usage(9)})
_DONE = b"data: [DONE]\n\n"


def test_a_stream_gets_the_prefills_cached_tokens_even_split_across_chunks() -> None:
    body = _TOKEN + _USAGE + _DONE
    cut = len(_TOKEN) + 20  # in the middle of the usage event
    for splice in (False, True):
        client = _Recorder(splice)
        sink = CachedTokensSink(client, 2)  # type: ignore[arg-type]

        async def relay(sink: CachedTokensSink = sink, splice: bool = splice) -> None:
            await sink.start(200, [])
            await sink.write(body[:cut])
            if splice:
                spliced = sink.splice()
                assert spliced is sink
                assert spliced.write_now(body[cut:], last=True)
            else:
                assert sink.splice() is None
                await sink.write(body[cut:])
            await sink.end()

        asyncio.run(relay())
        assert (
            b"".join(client.chunks) == _TOKEN + _event({"choices": [], "usage": _usage(2)}) + _DONE
        )
        assert client.chunks[0] == _TOKEN  # whole events pass at once
        assert client.ended


def test_a_stream_without_a_final_blank_line_is_passed_on_at_the_end() -> None:
    client = _Recorder(False)
    sink = CachedTokensSink(client, None)  # type: ignore[arg-type]

    async def relay() -> None:
        await sink.write(_USAGE + b"data: [DONE]")
        assert client.chunks == [_event({"choices": [], "usage": _usage(None)})]
        await sink.end()

    asyncio.run(relay())
    assert client.chunks[-1] == b"data: [DONE]" and client.ended
