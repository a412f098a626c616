"""One OpenAI chat-completion request, streaming (SSE) or not, timed on the client.

:func:`send_chat` writes the request with an existing :class:`aiohttp.ClientSession`,
reads the answer, and fills a :class:`~fastroute.loadgen.records.RequestRecord`.
It never raises for server or network failures: those become the record's
``error`` (the driver decides what a failed turn means for its session).
Cancellation (the run's deadline) propagates after the record is marked
``deadline``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import msgspec

from fastroute.loadgen.records import RequestRecord

__all__ = ["send_chat", "ChatReply", "error_code", "route_reason"]

ENGINE_HEADER = "x-fastroute-engine"
DECISION_HEADER = "x-fastroute-decision"


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning: str | None = None  # vLLM's reasoning parsers
    reasoning_content: str | None = None  # SGLang's (and older vLLM's)


class _ChunkChoice(msgspec.Struct):
    delta: _Delta | None = None
    text: str | None = None  # /v1/completions chunks
    finish_reason: str | None = None


class _PromptDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _PromptDetails | None = None


class _Chunk(msgspec.Struct):
    choices: list[_ChunkChoice] = []
    usage: _Usage | None = None
    error: dict[str, Any] | None = None


class _Message(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    message: _Message | None = None


class _Completion(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None


_chunk_decoder = msgspec.json.Decoder(_Chunk)
_completion_decoder = msgspec.json.Decoder(_Completion)


class ChatReply(msgspec.Struct):
    """The outcome of :func:`send_chat`: the record and the reply text (for the next turn)."""

    record: RequestRecord
    text: str


class _BadResponse(Exception):
    pass


class _StreamError(Exception):
    pass


def _apply_usage(record: RequestRecord, usage: _Usage | None) -> None:
    if usage is None:
        return
    record.prompt_tokens = usage.prompt_tokens
    if usage.prompt_tokens_details is not None:
        record.cached_tokens = usage.prompt_tokens_details.cached_tokens


def error_code(body: bytes) -> str | None:
    """The ``code`` of an error body as a string, in OpenAI's wrapped shape
    (``{"error": {"code": ...}}``: the proxy, vLLM, llama.cpp) or SGLang's flat one
    (``{"object": "error", "code": ...}``); None when there is none or the body is not JSON.

    The load driver is a client of any router (the peers included) and imports nothing of
    fastroute's server side, so it reads the two shapes itself.
    """
    try:
        doc = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    if not isinstance(doc, dict):
        return None
    err = doc.get("error")
    code = err.get("code") if isinstance(err, dict) else doc.get("code")
    if isinstance(code, bool) or not isinstance(code, str | int):
        return None
    return str(code)


def route_reason(decision: str | None) -> str | None:
    """The ``reason`` field of an ``x-fastroute-decision`` value
    (``policy=…;reason=…;rank=…``); None when there is no header or no such field."""
    for field in (decision or "").split(";"):
        name, _, value = field.partition("=")
        if name == "reason" and value:
            return value
    return None


async def _read_stream(resp: aiohttp.ClientResponse, record: RequestRecord, t_sent: float) -> str:
    """Consume an SSE body; set ttft/tbot/tokens on ``record``; return the reply text.

    An event whose delta carries text (``content``) or reasoning (``reasoning``, vLLM;
    ``reasoning_content``, SGLang) counts as a token; the reply is the content alone.
    """
    parts: list[str] = []
    first = last = 0.0
    max_gap = 0.0
    tokens = 0
    done = False
    async for raw in resp.content:
        if not raw.startswith(b"data:"):
            continue  # blank separators, comments, event: lines
        payload = raw[5:].strip()
        if payload == b"[DONE]":
            done = True
            # Read the body to its end, as the openai client does: a response left
            # unfinished closes its connection, and every next request pays a new one.
            await resp.read()
            break
        now = time.perf_counter()
        try:
            chunk = _chunk_decoder.decode(payload)
        except msgspec.DecodeError as exc:
            raise _BadResponse(str(exc)) from exc
        if chunk.error is not None:
            raise _StreamError(str(chunk.error.get("message", chunk.error))[:200])
        for choice in chunk.choices:
            delta = choice.delta
            text = delta.content if delta is not None else choice.text
            # reasoning tokens are output tokens too: the first of any kind is the TTFT
            thought = delta.reasoning or delta.reasoning_content if delta is not None else None
            if text:
                parts.append(text)
            if text or thought:
                if tokens == 0:
                    first = now
                else:
                    max_gap = max(max_gap, now - last)
                last = now
                tokens += 1
        _apply_usage(record, chunk.usage)
    if not done:
        raise _BadResponse("stream ended without data: [DONE]")
    record.output_tokens = tokens
    if tokens:
        record.ttft_s = first - t_sent
    if tokens > 1:
        record.tbot_s = (last - first) / (tokens - 1)
        record.max_gap_s = max_gap
    return "".join(parts)


async def _read_json(resp: aiohttp.ClientResponse, record: RequestRecord) -> str:
    body = await resp.read()
    try:
        completion = _completion_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise _BadResponse(str(exc)) from exc
    _apply_usage(record, completion.usage)
    if completion.usage is not None and completion.usage.completion_tokens is not None:
        record.output_tokens = completion.usage.completion_tokens
    if not completion.choices or completion.choices[0].message is None:
        raise _BadResponse("no choices[0].message in the response")
    return completion.choices[0].message.content or ""


async def send_chat(
    http: aiohttp.ClientSession,
    url: str,
    body: bytes,
    record: RequestRecord,
    *,
    headers: dict[str, str] | None = None,
    t0: float = 0.0,
) -> ChatReply:
    """POST ``body`` to ``url`` (a ``/v1/chat/completions`` URL) and time the answer.

    Parameters
    ----------
    http : aiohttp.ClientSession
        Carries the connection pool and the per-request timeout.
    url : str
        Full URL of the endpoint.
    body : bytes
        The JSON request; ``record.stream`` must match its ``stream`` field.
    record : RequestRecord
        Filled in place: ``sent_at_s`` (relative to ``t0``), status, engine, latencies.
    headers : dict, optional
        Extra request headers (e.g. the session id).
    t0 : float
        ``time.perf_counter()`` at the start of the run.

    Returns
    -------
    ChatReply
        The record and the reply text ("" on failure).
    """
    all_headers = {"Content-Type": "application/json"}
    if headers:
        all_headers.update(headers)
    t_sent = time.perf_counter()
    record.sent_at_s = t_sent - t0
    text = ""
    try:
        async with http.post(url, data=body, headers=all_headers) as resp:
            record.status = resp.status
            record.engine = resp.headers.get(ENGINE_HEADER)
            record.route_reason = route_reason(resp.headers.get(DECISION_HEADER))
            if resp.status != 200:
                record.error = f"http_{resp.status}"
                record.error_code = error_code(await resp.read())
            elif record.stream:
                text = await _read_stream(resp, record, t_sent)
            else:
                text = await _read_json(resp, record)
    except asyncio.CancelledError:
        record.error = "deadline"
        raise
    except TimeoutError:
        record.error = "timeout"
    except aiohttp.ClientConnectorError:
        record.error = "connect"
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, ConnectionError):
        record.error = "disconnected"
    except aiohttp.ClientResponseError:
        record.error = "bad_response"
    except aiohttp.ClientError:
        record.error = "disconnected"
    except _StreamError:
        record.error = "stream_error"
    except _BadResponse:
        record.error = "bad_response"
    finally:
        record.e2e_s = time.perf_counter() - t_sent
    return ChatReply(record, text if record.error is None else "")
