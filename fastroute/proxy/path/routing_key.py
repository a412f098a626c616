"""The routing key: what makes requests of one conversation land on one engine.

KV-cache reuse needs follow-up requests of a conversation to reach the engine that
already holds its prefix, so the key must be the same for every turn and different
across conversations. Sources, first present wins (docs/design.md §3 step 4):

====================  ================================================================
source                key material
====================  ================================================================
``header``            the session header (default ``x-session-id``): the client said so
``prompt_cache_key``  OpenAI's ``prompt_cache_key`` body field, an explicit cache key
``user``              the ``user`` body field
``conversation``      chat: the messages *through the first user message* (system
                      prompt + first user message). Later turns append messages, so
                      the key never changes within a conversation; the system prompt
                      alone is never used, because many conversations share it
``prompt``            completions: the first :data:`PROMPT_KEY_PREFIX_BYTES` bytes of
                      the prompt text, or its first :data:`PROMPT_KEY_PREFIX_TOKENS`
                      token ids (for a batch, of its first prompt): prompts that share
                      a template prefix share an engine, and so its prefix cache
``request_id``        nothing to be sticky to (no user message, empty prompt): the
                      request id the caller passed, which spreads such requests
``none``              as above with no request id: key hash 0
====================  ================================================================

Identifiers (header, ``prompt_cache_key``, ``user``) are hashed as they are, so any
component that knows a session id computes the same key with
:func:`fastroute.hashing.key_hash`. Derived keys hash a canonical byte string that
starts with a tag (``\\0chat\\0``, ``\\0text\\0``, ``\\0toks\\0``), so they cannot
collide with each other by construction.

Canonical conversation form: for each message up to and including the first with role
``user``, its role and its content, each length-prefixed (8 bytes, little-endian) and
the content preceded by a kind byte, so the encoding is injective. Content made only
of text parts is their texts joined by ``"\\n"`` (how vLLM renders them), so
``"a\\nb"`` and ``[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]``
are the same conversation; with other parts, each part contributes its type and its
payload (image URL, audio data, file id or data). A client that rewrites or trims
early history (sliding-window chat) starts a new key.

All keys are xxh3-64 (:func:`fastroute.hashing.key_hash`), the same in every process
and on every host.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping

import msgspec

from fastroute.hashing import PROMPT_KEY_PREFIX_BYTES, key_hash
from fastroute.proxy.path.requests import (
    ChatRequest,
    CompletionRequest,
    ContentPart,
    ImageURL,
    ParsedRequest,
)

__all__ = [
    "KeySource",
    "routing_key",
    "conversation_key_bytes",
    "prompt_key_bytes",
    "estimate_prompt_tokens",
    "DEFAULT_SESSION_HEADER",
    "PROMPT_KEY_PREFIX_BYTES",
    "PROMPT_KEY_PREFIX_TOKENS",
    "BYTES_PER_TOKEN_ESTIMATE",
    "MESSAGE_OVERHEAD_TOKENS",
    "NON_TEXT_PART_TOKENS",
]

#: Header carrying an explicit session id.
DEFAULT_SESSION_HEADER = "x-session-id"
#: Token ids of a completion prompt that form its key (the same ~1 KiB).
PROMPT_KEY_PREFIX_TOKENS = 256
#: Bytes of UTF-8 text per token in :func:`estimate_prompt_tokens` (close to Llama-3's
#: average on English; the engine emulator uses the same figure).
BYTES_PER_TOKEN_ESTIMATE = 4
#: Tokens a chat template adds per message (role header and end-of-turn markers).
MESSAGE_OVERHEAD_TOKENS = 4
#: Tokens counted per non-text content part (image, audio, file): a 336-px image is
#: 576 tokens in LLaVA-1.5; other encoders differ, this is a rough default.
NON_TEXT_PART_TOKENS = 576

_TAG_CHAT = b"\0chat\0"
_TAG_TEXT = b"\0text\0"
_TAG_TOKENS = b"\0toks\0"
_encode_json = msgspec.json.encode


class KeySource(enum.StrEnum):
    """Where a routing key came from (a ``str``, for logs and decision records)."""

    HEADER = "header"
    PROMPT_CACHE_KEY = "prompt_cache_key"
    USER = "user"
    CONVERSATION = "conversation"
    PROMPT = "prompt"
    REQUEST_ID = "request_id"
    NONE = "none"


def _put(out: bytearray, data: bytes) -> None:
    out += len(data).to_bytes(8, "little")
    out += data


def _part_payload(part: ContentPart) -> bytes:
    if part.text is not None:
        return part.text.encode()
    if part.image_url is not None:
        url = part.image_url.url if isinstance(part.image_url, ImageURL) else part.image_url
        return url.encode()
    if part.input_audio is not None:
        return part.input_audio.data.encode()
    if part.file is not None:
        f = part.file
        return (f.file_id or f.file_data or f.filename or "").encode()
    return b""


def _put_content(out: bytearray, content: str | list[ContentPart] | None) -> None:
    # A kind byte keeps text and part lists apart: b"s" text (also text-only part
    # lists, rendered as the engine renders them), b"p" anything with other parts.
    if content is None:
        out += b"s"
        _put(out, b"")
    elif isinstance(content, str):
        out += b"s"
        _put(out, content.encode())
    elif all(p.type == "text" for p in content):
        out += b"s"
        _put(out, "\n".join(p.text or "" for p in content).encode())
    else:
        out += b"p"
        out += len(content).to_bytes(8, "little")
        for part in content:
            _put(out, part.type.encode())
            _put(out, _part_payload(part))


def conversation_key_bytes(request: ChatRequest) -> bytes | None:
    """The canonical bytes of a chat through its first user message.

    Returns
    -------
    bytes or None
        None when there is no user message (the system prompt alone is not a key).
    """
    out = bytearray(_TAG_CHAT)
    for message in request.messages:
        _put(out, message.role.encode())
        _put_content(out, message.content)
        if message.role == "user":
            return bytes(out)
    return None


def prompt_key_bytes(request: CompletionRequest) -> bytes | None:
    """The canonical bytes of a completion prompt's prefix (of the first prompt of a batch).

    Returns
    -------
    bytes or None
        None for an empty prompt.
    """
    prompt = request.prompt
    text: str
    if isinstance(prompt, str):
        text = prompt
    elif not prompt:
        return None
    elif isinstance(prompt[0], int):  # one prompt of token ids
        return _TAG_TOKENS + _encode_json(prompt[:PROMPT_KEY_PREFIX_TOKENS])
    elif isinstance(prompt[0], list):  # a batch of token-id prompts
        if not prompt[0]:
            return None
        return _TAG_TOKENS + _encode_json(prompt[0][:PROMPT_KEY_PREFIX_TOKENS])
    else:  # a batch of text prompts
        text = prompt[0]
    if not text:
        return None
    # Cutting characters first avoids encoding a long prompt; N characters are at
    # least N bytes, so the byte prefix is the same.
    n = PROMPT_KEY_PREFIX_BYTES
    return _TAG_TEXT + text[:n].encode()[:n]


def _identifier(value: str | None) -> str | None:
    if value is None:
        return None
    value = value.strip()
    return value or None


def routing_key(
    parsed: ParsedRequest,
    headers: Mapping[str, str],
    session_header: str = DEFAULT_SESSION_HEADER,
    *,
    request_id: str | None = None,
) -> tuple[int, str]:
    """Compute a request's routing key hash and say where it came from.

    Parameters
    ----------
    parsed : ChatRequest or CompletionRequest
        The minimal parse of the body (:mod:`fastroute.proxy.path.requests`).
    headers : mapping of str to str
        Request headers: a case-insensitive mapping such as aiohttp's
        ``request.headers``, or a plain ``dict`` with lower-case names.
    session_header : str
        Header carrying an explicit session id (default ``x-session-id``); empty or
        blank values are ignored.
    request_id : str, optional
        Used as the key when the request has nothing to be sticky to.

    Returns
    -------
    (int, str)
        The unsigned 64-bit key hash and its source, a :class:`KeySource` value.
    """
    session = _identifier(headers.get(session_header.lower()))
    if session is not None:
        return key_hash(session), KeySource.HEADER
    cache_key = _identifier(parsed.prompt_cache_key)
    if cache_key is not None:
        return key_hash(cache_key), KeySource.PROMPT_CACHE_KEY
    user = _identifier(parsed.user)
    if user is not None:
        return key_hash(user), KeySource.USER
    if isinstance(parsed, ChatRequest):
        material = conversation_key_bytes(parsed)
        if material is not None:
            return key_hash(material), KeySource.CONVERSATION
    else:
        material = prompt_key_bytes(parsed)
        if material is not None:
            return key_hash(material), KeySource.PROMPT
    if request_id is not None:
        return key_hash(request_id), KeySource.REQUEST_ID
    return 0, KeySource.NONE


def _text_tokens(text: str) -> int:
    return math.ceil(len(text.encode()) / BYTES_PER_TOKEN_ESTIMATE)


def estimate_prompt_tokens(parsed: ParsedRequest) -> int:
    """Estimate a request's prompt tokens for load accounting, without a tokenizer.

    Text counts ``ceil(utf8_bytes / 4)`` tokens (:data:`BYTES_PER_TOKEN_ESTIMATE`);
    chat adds :data:`MESSAGE_OVERHEAD_TOKENS` per message and
    :data:`NON_TEXT_PART_TOKENS` per image/audio/file part; token-id prompts count
    exactly. Batches sum their prompts. Expect ±30 % on English text, worse on code
    and other scripts: good enough to weigh load, not to enforce context limits.

    Returns
    -------
    int
        Estimated prompt tokens, ``>= 0``.
    """
    if isinstance(parsed, ChatRequest):
        total = 0
        for message in parsed.messages:
            total += MESSAGE_OVERHEAD_TOKENS
            content = message.content
            if isinstance(content, str):
                total += _text_tokens(content)
            elif content is not None:
                for part in content:
                    if part.type == "text":
                        total += _text_tokens(part.text or "")
                    else:
                        total += NON_TEXT_PART_TOKENS
        return total
    prompt = parsed.prompt
    if isinstance(prompt, str):
        return _text_tokens(prompt)
    total = 0
    for item in prompt:
        if isinstance(item, str):
            total += _text_tokens(item)
        elif isinstance(item, int):
            total += 1
        else:
            total += len(item)
    return total
