"""A deterministic approximation of tokenization, and the chat template.

One definition for every part that must agree on token counts and KV block hashes: the
engine emulator (which serves prompts), the workload generators (which build prompt text
to an exact token count) and the simulator. It sits at the top of the package, below all
of them and depending only on :mod:`fastroute.hashing` and :mod:`fastroute.hardware`, so
the workload generators (shared by the simulator, the fleet benchmark and the demo) never
import the fake engines.

There is no vocabulary. A prompt's text is encoded as UTF-8 and cut into
fixed-width chunks of :data:`BYTES_PER_TOKEN` (4) bytes; each chunk is one
token whose id is the chunk read as a little-endian ``uint32`` (the last chunk
zero-padded). Four bytes per token is close to the average of Llama-3's
tokenizer on English text, it costs one ``len()`` to count, and, because chunks
start at byte 0, two prompts that share a text prefix share their leading
tokens — so they share KV blocks in the prefix cache, as real prompts do.

Completions may pass ``prompt`` as a list of token ids instead; a list equal to
the chunking of a text hashes identically to that text.

KV blocks are identified by chained hashes, as in vLLM's prefix cache:
``h_i = xxh3_64(h_{i-1} as 8 bytes ‖ bytes of block i)``, one per *full* block
of :data:`~fastroute.hardware.BLOCK_SIZE_TOKENS` tokens.

Chat messages are rendered with a Llama-3-style template (documented in
``docs/emulator.md``)::

    <|begin_of_text|><|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>…
    <|start_header_id|>assistant<|end_header_id|>\\n\\n
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from fastroute.hardware import BLOCK_SIZE_TOKENS
from fastroute.hashing import key_hash

__all__ = [
    "BYTES_PER_TOKEN",
    "TokenizedPrompt",
    "count_text_tokens",
    "tokenize_text",
    "tokenize_ids",
    "text_token_ids",
    "token_ids_text",
    "render_chat",
]

BYTES_PER_TOKEN = 4
_BLOCK_BYTES = BYTES_PER_TOKEN * BLOCK_SIZE_TOKENS
_MAX_TOKEN_ID = 2**32 - 1


@dataclass(frozen=True, slots=True)
class TokenizedPrompt:
    """A prompt as the engine model sees it.

    Attributes
    ----------
    num_tokens : int
        Prompt length in tokens (what ``usage.prompt_tokens`` reports).
    block_hashes : tuple of int
        Chained hash of each full block, in order.
    """

    num_tokens: int
    block_hashes: tuple[int, ...]


def count_text_tokens(text: str) -> int:
    """Return the number of tokens of ``text`` (ceil of UTF-8 bytes / 4)."""
    return -(-len(text.encode("utf-8")) // BYTES_PER_TOKEN)


def _chain(blocks: Iterable[bytes]) -> tuple[int, ...]:
    hashes = []
    prev = 0
    for block in blocks:
        prev = key_hash(prev.to_bytes(8, "little") + block)
        hashes.append(prev)
    return tuple(hashes)


def tokenize_text(text: str) -> TokenizedPrompt:
    """Tokenize ``text`` into 4-byte chunks and hash its full blocks.

    Parameters
    ----------
    text : str
        Prompt text.

    Returns
    -------
    TokenizedPrompt
    """
    data = text.encode("utf-8")
    num_tokens = -(-len(data) // BYTES_PER_TOKEN)
    num_full = num_tokens // BLOCK_SIZE_TOKENS
    if num_full:
        # Only the last token of the prompt can be a short chunk; pad it as its id does.
        padded = data.ljust(num_tokens * BYTES_PER_TOKEN, b"\0")
        blocks = (padded[i * _BLOCK_BYTES : (i + 1) * _BLOCK_BYTES] for i in range(num_full))
        return TokenizedPrompt(num_tokens, _chain(blocks))
    return TokenizedPrompt(num_tokens, ())


def text_token_ids(text: str) -> list[int]:
    """The token ids of ``text``: each 4-byte chunk of its UTF-8 as a little-endian
    ``uint32``, the last chunk zero-padded (so ``tokenize_ids(text_token_ids(t))`` hashes
    like ``tokenize_text(t)`` and has ``count_text_tokens(t)`` tokens)."""
    data = text.encode("utf-8")
    n = -(-len(data) // BYTES_PER_TOKEN)
    return list(struct.unpack(f"<{n}I", data.ljust(n * BYTES_PER_TOKEN, b"\0")))


def token_ids_text(token_ids: Sequence[int]) -> str:
    """The text of token ids from :func:`text_token_ids` (the padding dropped; bytes that
    are not UTF-8 become U+FFFD).

    Raises
    ------
    ValueError
        If an id is not an integer in ``[0, 2**32)``.
    """
    for tok in token_ids:
        if type(tok) is not int or not 0 <= tok <= _MAX_TOKEN_ID:
            raise ValueError(f"token ids must be integers in [0, {_MAX_TOKEN_ID}], got {tok!r}")
    data = struct.pack(f"<{len(token_ids)}I", *token_ids)
    return data.rstrip(b"\0").decode("utf-8", "replace")


def tokenize_ids(token_ids: Sequence[int]) -> TokenizedPrompt:
    """Hash a prompt given as token ids (each in ``[0, 2**32)``).

    Raises
    ------
    ValueError
        If an id is not an integer in range.
    """
    for tok in token_ids:
        if type(tok) is not int or not 0 <= tok <= _MAX_TOKEN_ID:
            raise ValueError(f"token ids must be integers in [0, {_MAX_TOKEN_ID}], got {tok!r}")
    n = len(token_ids)
    num_full = n // BLOCK_SIZE_TOKENS
    fmt = f"<{BLOCK_SIZE_TOKENS}I"
    blocks = (
        struct.pack(fmt, *token_ids[i * BLOCK_SIZE_TOKENS : (i + 1) * BLOCK_SIZE_TOKENS])
        for i in range(num_full)
    )
    return TokenizedPrompt(n, _chain(blocks))


def _content_text(content: object) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        # OpenAI content parts: keep the text parts, ignore images/audio (no vision model).
        return "".join(
            str(part.get("text", ""))
            for part in content
            if isinstance(part, Mapping) and part.get("type") == "text"
        )
    raise ValueError("message content must be a string or a list of content parts")


def render_chat(
    messages: Sequence[Mapping[str, object]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """Render chat messages to prompt text with the Llama-3-style template.

    Parameters
    ----------
    messages : sequence of mappings
        OpenAI chat messages (``role``, ``content``).
    add_generation_prompt : bool
        End with the assistant header (the generation prompt).
    continue_final_message : bool
        Leave the last message open (no end-of-turn): the model continues it (vLLM's
        ``continue_final_message``).

    Returns
    -------
    str
        The prompt, ending with the assistant header (generation prompt) unless told not to.

    Raises
    ------
    ValueError
        If a message is not an object with a string ``role``.
    """
    parts = ["<|begin_of_text|>"]
    for message in messages:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ValueError("each message must be an object with a string 'role'")
        parts.append(
            f"<|start_header_id|>{message['role']}<|end_header_id|>\n\n"
            f"{_content_text(message.get('content'))}<|eot_id|>"
        )
    if continue_final_message and messages:
        parts[-1] = parts[-1].removesuffix("<|eot_id|>")
    if add_generation_prompt:
        parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(parts)
