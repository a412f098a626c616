"""The bytes of a mid-stream migration: what a broken stream relayed, the request that
continues it on another engine, and the continuation's events as the client must see them.

Everything here runs only once a stream broke (or on a continuation's events); the
happy path never decodes anything of it. See docs/failure-handling.md, "Mid-stream
migration".

* :func:`relayed_text`: the output text of the SSE events relayed so far, the first
  event's ``id`` and ``created``, and whether the stream can be continued at all
  (reasoning, tool calls or another choice in it cannot).
* :func:`continuation_body`: the request re-sent with that text appended — chat: a
  partial final assistant message with ``continue_final_message: true`` and
  ``add_generation_prompt: false`` (vLLM, SGLang); completions: the prompt plus the
  text — and ``max_tokens`` / ``max_completion_tokens`` / ``min_tokens`` reduced by
  the tokens already sent. Requests whose continuation would not be what one engine
  would have produced are refused with the reason (:data:`NOT_MIGRATED`).
* :class:`SegmentRewriter`: a continuation's events with the first segment's ``id``
  and ``created``, without a second role event, and with the usage summed over the
  segments.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from fastroute.proxy.path.sse import DATA_PREFIX, has_token

__all__ = [
    "NOT_CONTINUABLE_KINDS",
    "NOT_MIGRATED",
    "RelayedText",
    "relayed_text",
    "continuation_body",
    "SegmentRewriter",
]

#: Engine kinds that cannot continue a partial assistant turn exactly: llama.cpp's server
#: has no ``continue_final_message``; an ``openai`` engine is any OpenAI-compatible
#: server, which may not have it either.
NOT_CONTINUABLE_KINDS = frozenset({"llamacpp", "openai"})

#: Why a request is not migrated, by what it asks for.
NOT_MIGRATED = {
    "n": "n > 1: several choices cannot be continued as one",
    "logprobs": "logprobs: the continuation's would be of a different prompt",
    "guided": "guided decoding: the grammar would restart inside the partial output",
    "echo": "echo: the continuation would echo the text so far as prompt",
    "prompt": "a token-id or batched prompt: the text cannot be appended exactly",
    "max_tokens": "the output already reached max_tokens",
    "body": "the request body is not a JSON object",
}
#: Fields that turn on guided (structured) decoding in vLLM or SGLang.
_GUIDED_FIELDS = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "json_schema",
    "regex",
    "ebnf",
)
_EVENT_END = b"\n\n"
_DONE = b"[DONE]"
_ROLE = b'"role":"assistant"'
_USAGE_KEY = b'"usage":{'
_decode = msgspec.json.decode
_encode = msgspec.json.encode


@dataclass(slots=True)
class RelayedText:
    """What the events relayed to the client so far carried.

    Attributes
    ----------
    text : str
        The output text (chat ``delta.content``, completions ``text``), concatenated.
    response_id : str or None
        The first event's ``id``.
    created : int or None
        The first event's ``created``.
    blocker : str or None
        Why the stream cannot be continued (None: it can).
    """

    text: str
    response_id: str | None
    created: int | None
    blocker: str | None = None


def _events(chunks: Iterable[bytes]) -> Iterable[dict[str, Any]]:
    """The JSON objects of the SSE data events in ``chunks`` (whole events)."""
    for raw in b"".join(chunks).replace(b"\r\n", b"\n").split(_EVENT_END):
        line = raw.strip()
        if not line.startswith(DATA_PREFIX):
            continue
        data = line[len(DATA_PREFIX) :].strip()
        if data == _DONE:
            continue
        try:
            obj = _decode(data)
        except msgspec.DecodeError:
            continue
        if isinstance(obj, dict):
            yield obj


def _choice_text(choice: dict[str, Any], chat: bool) -> tuple[str, str | None]:
    """One choice's text and why it cannot be continued (None: it can)."""
    if choice.get("index", 0) != 0:
        return "", NOT_MIGRATED["n"]
    if not chat:
        return str(choice.get("text") or ""), None
    delta = choice.get("delta") or {}
    if delta.get("reasoning") or delta.get("reasoning_content"):
        return "", "reasoning in the stream: a partial turn cannot carry it"
    if delta.get("tool_calls"):
        return "", "tool calls in the stream: a partial turn cannot carry them"
    return str(delta.get("content") or ""), None


def relayed_text(chunks: Iterable[bytes], chat: bool) -> RelayedText:
    """The text, first ``id`` and ``created`` of the SSE events in ``chunks``."""
    parts: list[str] = []
    out = RelayedText("", None, None)
    for event in _events(chunks):
        if out.response_id is None and isinstance(event.get("id"), str):
            out.response_id = event["id"]
            created = event.get("created")
            out.created = created if isinstance(created, int) else None
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            text, blocker = _choice_text(choice, chat)
            if blocker is not None:
                out.blocker = blocker
                return out
            parts.append(text)
    out.text = "".join(parts)
    return out


def _refusal(body: dict[str, Any], chat: bool) -> str | None:
    """Why ``body`` is not migrated (None: it may be)."""
    n = body.get("n")
    best_of = body.get("best_of")
    if (isinstance(n, int) and n > 1) or (isinstance(best_of, int) and best_of > 1):
        return NOT_MIGRATED["n"]
    if body.get("logprobs") or body.get("top_logprobs") or body.get("prompt_logprobs"):
        return NOT_MIGRATED["logprobs"]
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type", "text") != "text":
        return NOT_MIGRATED["guided"]
    if any(body.get(name) is not None for name in _GUIDED_FIELDS):
        return NOT_MIGRATED["guided"]
    if body.get("echo"):
        return NOT_MIGRATED["echo"]
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return NOT_MIGRATED["prompt"]
    elif not isinstance(body.get("messages"), list):
        return NOT_MIGRATED["body"]
    return None


def _reduce(body: dict[str, Any], tokens_sent: int) -> bool:
    """Take ``tokens_sent`` off the body's token limits; False when none is left."""
    for name in ("max_tokens", "max_completion_tokens"):
        limit = body.get(name)
        if isinstance(limit, int) and not isinstance(limit, bool):
            if limit - tokens_sent < 1:
                return False
            body[name] = limit - tokens_sent
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int) and min_tokens > 0:
        body["min_tokens"] = max(0, min_tokens - tokens_sent)
    return True


def _append_turn(body: dict[str, Any], text: str) -> None:
    """Chat: ``text`` as the partial final assistant message (appended to the client's
    own partial one when it asked to continue it)."""
    messages = list(body["messages"])
    last = messages[-1] if messages else None
    if (
        body.get("continue_final_message")
        and isinstance(last, dict)
        and last.get("role") == "assistant"
        and isinstance(last.get("content"), str)
    ):
        messages[-1] = {**last, "content": last["content"] + text}
    else:
        messages.append({"role": "assistant", "content": text})
    body["messages"] = messages
    body["continue_final_message"] = True
    body["add_generation_prompt"] = False


def continuation_body(
    body: bytes, chat: bool, text: str, tokens_sent: int
) -> tuple[bytes | None, str | None]:
    """The request that continues ``body``'s output after ``text`` (``tokens_sent``
    tokens): (the body, None), or (None, why it is not migrated)."""
    try:
        decoded = _decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None, NOT_MIGRATED["body"]
    if not isinstance(decoded, dict):
        return None, NOT_MIGRATED["body"]
    refusal = _refusal(decoded, chat)
    if refusal is not None:
        return None, refusal
    if not _reduce(decoded, tokens_sent):
        return None, NOT_MIGRATED["max_tokens"]
    if chat:
        _append_turn(decoded, text)
    else:
        prompt = decoded["prompt"]
        decoded["prompt"] = (prompt if isinstance(prompt, str) else prompt[0]) + text
    return _encode(decoded), None


def _split_events(data: bytes) -> list[bytes]:
    """``data`` (whole events) as its events, each with its blank line."""
    return [e + _EVENT_END for e in data.split(_EVENT_END) if e]


class SegmentRewriter:
    """A continuation's events as the client's one stream must carry them.

    Parameters
    ----------
    response_id : str
        The first segment's ``id``: every continuation event gets it.
    created : int or None
        The first segment's ``created`` (None: left as the continuation's).
    tokens_before : int
        Output tokens of the segments before: added to each ``usage.completion_tokens``
        (and ``total_tokens``), so the usage is summed over the segments.
    """

    __slots__ = ("response_id", "created", "tokens_before", "_pairs", "_started")

    def __init__(self, response_id: str, created: int | None, tokens_before: int) -> None:
        self.response_id = response_id
        self.created = created
        self.tokens_before = tokens_before
        self._pairs: list[tuple[bytes, bytes]] | None = None  # (continuation's, first's)
        self._started = False  # a token event went out: no role event can follow

    def rewrite(self, data: bytes) -> bytes:
        """The bytes to relay for ``data`` (whole events of the continuation)."""
        if not data:
            return data
        if not self._started or _USAGE_KEY in data:
            return b"".join(self._event(e) for e in _split_events(data))
        return self._ids(data)

    def _learn(self, event: dict[str, Any]) -> None:
        """The continuation's ``id``/``created`` bytes and what replaces them."""
        pairs: list[tuple[bytes, bytes]] = []
        cid = event.get("id")
        if isinstance(cid, str) and cid != self.response_id:
            pairs.append((_encode(cid), _encode(self.response_id)))
        created = event.get("created")
        if isinstance(created, int) and self.created is not None and created != self.created:
            for sep in (b":", b": "):
                old = b'"created"' + sep + str(created).encode()
                pairs.append((old, b'"created"' + sep + str(self.created).encode()))
        self._pairs = pairs

    def _ids(self, data: bytes) -> bytes:
        for old, new in self._pairs or ():
            data = data.replace(old, new)
        return data

    def _event(self, event: bytes) -> bytes:
        """One whole event: drop a role-only event, sum a usage, rewrite the ids."""
        line = event.strip()
        if not line.startswith(DATA_PREFIX) or line[len(DATA_PREFIX) :].strip() == _DONE:
            return event
        try:
            obj = _decode(line[len(DATA_PREFIX) :])
        except msgspec.DecodeError:
            return self._ids(event)
        if not isinstance(obj, dict):
            return event
        if self._pairs is None:
            self._learn(obj)
        changed = False
        if not self._started:
            if has_token(event):
                self._started = True
            if _ROLE in line.replace(b": ", b":"):
                if not self._started:
                    return b""  # the continuation's role event: the client had one
                changed = _drop_role(obj)
        usage = obj.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            usage["completion_tokens"] += self.tokens_before
            if isinstance(usage.get("total_tokens"), int):
                usage["total_tokens"] += self.tokens_before
            changed = True
        if not changed:
            return self._ids(event)
        return self._ids(DATA_PREFIX + _encode(obj) + _EVENT_END)


def _drop_role(event: dict[str, Any]) -> bool:
    """Remove ``delta.role`` from the event's choices; whether any had one."""
    dropped = False
    for choice in event.get("choices") or ():
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if isinstance(delta, dict) and "role" in delta:
            del delta["role"]
            dropped = True
    return dropped
