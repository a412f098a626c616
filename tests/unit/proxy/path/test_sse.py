"""Output-token event counting over relayed SSE chunks."""

from __future__ import annotations

import pytest

from fastroute.proxy.path.sse import DATA_PREFIX, USAGE_MARK, output_events

ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}\n\n'
DONE = b"data: [DONE]\n\n"


def token(i: int) -> bytes:
    return b'data: {"choices":[{"index":0,"delta":{"content":" w%d"}}]}\n\n' % i


def count(chunks: list[bytes]) -> int:
    return output_events(
        sum(c.count(DATA_PREFIX) for c in chunks),
        sum(c.count(USAGE_MARK) for c in chunks),
        chunks[0],
        chunks[-1],
    )


@pytest.mark.parametrize(
    "chunks, expected",
    [
        ([ROLE, token(0), token(1), token(2), DONE], 3),  # chat, one event per chunk
        ([ROLE + token(0), token(1), token(2) + DONE], 3),  # coalesced reads
        ([ROLE, token(0), token(1), token(2), USAGE, DONE], 3),  # include_usage
        ([ROLE, token(0), token(1), token(2) + USAGE + DONE], 3),
        ([token(0), token(1), DONE], 2),  # completions: no role event
        ([token(0), token(1)], 2),  # stream cut before [DONE]
        ([ROLE, DONE], 0),  # empty output
        ([ROLE], 0),
    ],
)
def test_output_events_counts_only_token_events(chunks, expected):
    assert count(chunks) == expected


def test_an_eight_token_chat_stream_has_seven_gaps_not_nine():
    chunks = [ROLE] + [token(i) for i in range(8)] + [DONE]
    assert len(chunks) - 1 == 9  # what the chunk count gave before: TBOT 22 % low
    assert count(chunks) - 1 == 7
