"""The chaos run's clients: streamed chats whose every byte is checked, and each one's outcome.

Each request is a streamed chat with a unique prompt. The emulated engines' output is a
function of the prompt (:func:`fastroute.emulator.output_text.chat_output`), the same on
every engine, and a migrated stream goes on where the broken one stopped; so the client knows
the exact text it must receive. A request ends in one of:

* ``completed`` — ``[DONE]`` arrived and the text is exactly the expected output's first
  ``n`` tokens, ``n`` the usage's ``completion_tokens`` (no token repeated, lost or changed);
* ``failed`` — an HTTP error after the client's retries, an in-stream error event, a broken
  connection, or a stream that ended without ``[DONE]``; the reason says which;
* ``corrupt`` — the stream completed but its text is not the expected one (a relay defect;
  the run's verdict requires none).

The client retries like the official ``openai`` client does (``max_retries = 2``): on a
connection error or a 408/409/429/5xx before any body byte, after 0.5 s then 1 s.
After the stream, the proxy's decision record (``GET /admin/decisions/{id}``, loopback) says
whether it was migrated (more than one segment); the records live per worker, so the lookup
opens up to :data:`RECORD_LOOKUPS` fresh connections.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import aiohttp

from fastroute.emulator.output_text import chat_output

__all__ = ["CLIENT_RETRIES", "ChaosTarget", "Outcome", "expected_text", "run_request"]

#: Retries of a request that failed before its body, as the openai client's default.
CLIENT_RETRIES = 2
#: Fresh connections tried to find a request's decision record (2 workers: a miss is 2^-8).
RECORD_LOOKUPS = 8
#: Bound on one request, seconds (a hung engine is left by the proxy's own timeouts first).
REQUEST_TIMEOUT_S = 120.0
_RETRY_STATUSES = frozenset({408, 409, 429})


@dataclass(frozen=True)
class ChaosTarget:
    """Where the clients send: the proxy's root URL, the model, the output length asked."""

    url: str
    model: str
    max_tokens: int


@dataclass
class Outcome:
    """What happened to one client request.

    Attributes
    ----------
    index : int
    start_s, end_s : float
        Seconds after the run's start.
    result : str
        ``completed``, ``failed`` or ``corrupt``.
    reason : str
        Why it failed (or was corrupt); empty when completed.
    tokens : int
        Output tokens received.
    request_id : str or None
        The proxy's ``x-request-id``.
    migrated : bool or None
        Its decision record has several segments; None when the record was not found.
    """

    index: int
    start_s: float
    end_s: float
    result: str
    reason: str
    tokens: int
    request_id: str | None
    migrated: bool | None = None


def _messages(index: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"chaos request {index}: tell me a long story"}]


def expected_text(index: int, n_tokens: int) -> str:
    """The first ``n_tokens`` of the output request ``index`` makes on any engine."""
    out = chat_output(_messages(index))
    return "".join(out.token(i) for i in range(n_tokens))


@dataclass
class _Stream:
    text: str = ""
    done: bool = False
    error: str = ""
    completion_tokens: int | None = None


async def _read_stream(resp: aiohttp.ClientResponse, got: _Stream) -> None:
    """Read the SSE body into ``got`` (partly filled if the connection breaks)."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            got.done = True
            continue
        event = json.loads(data)
        if "error" in event:
            got.error = str(event["error"].get("message", event["error"]))[:200]
            continue
        for choice in event.get("choices") or ():
            got.text += (choice.get("delta") or {}).get("content") or ""
        if event.get("usage"):
            got.completion_tokens = event["usage"].get("completion_tokens")


def _judge(got: _Stream, index: int) -> tuple[str, str, int]:
    """(result, reason, tokens) of a stream that answered 200."""
    n = got.completion_tokens
    tokens = n if n is not None else len(got.text.split())
    if got.error:
        return "failed", f"stream error: {got.error}", tokens
    if not got.done:
        return "failed", "stream ended without [DONE]", tokens
    if n is None:
        return "corrupt", "no usage in a completed stream", tokens
    if got.text != expected_text(index, n):
        return "corrupt", f"text differs from the expected {n} tokens", tokens
    return "completed", "", tokens


async def _lookup_migrated(url: str, request_id: str) -> bool | None:
    for _ in range(RECORD_LOOKUPS):
        connector = aiohttp.TCPConnector(force_close=True)
        timeout = aiohttp.ClientTimeout(total=5.0)
        try:
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
                async with http.get(f"{url}/admin/decisions/{request_id}") as resp:
                    if resp.status == 200:
                        record = await resp.json()
                        return len(record.get("segments") or ()) > 1
        except (aiohttp.ClientError, TimeoutError):
            pass
    return None


async def run_request(
    http: aiohttp.ClientSession, target: ChaosTarget, index: int, t0: float
) -> Outcome:
    """Send request ``index`` to ``target`` and judge what came back."""
    start = time.monotonic() - t0
    body = {
        "model": target.model, "messages": _messages(index), "stream": True,
        "max_tokens": target.max_tokens, "stream_options": {"include_usage": True},
    }  # fmt: skip
    result, reason, rid, got = "failed", "", None, _Stream()
    for attempt in range(CLIENT_RETRIES + 1):
        if attempt:
            await asyncio.sleep(0.5 * 2 ** (attempt - 1))
        try:
            async with http.post(f"{target.url}/v1/chat/completions", json=body) as resp:
                rid = resp.headers.get("x-request-id")
                if resp.status != 200:
                    text = (await resp.read()).decode(errors="replace")[:200]
                    reason = f"HTTP {resp.status}: {text}"
                    if resp.status in _RETRY_STATUSES or resp.status >= 500:
                        continue
                    break
                await _read_stream(resp, got)
                result, reason, _ = _judge(got, index)
                break
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
            reason = f"connection: {type(exc).__name__}: {exc}"[:200]
            if got.text:
                break  # the body had begun: the openai client does not retry a stream
    tokens = _judge(got, index)[2]
    migrated = await _lookup_migrated(target.url, rid) if rid and result == "completed" else None
    return Outcome(index, start, time.monotonic() - t0, result, reason, tokens, rid, migrated)
