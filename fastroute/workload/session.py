"""Chat sessions and their prompt text.

Text is plain ASCII built so that it tokenizes, under the emulator's rule
(:mod:`fastroute.tokens`: 4 UTF-8 bytes per token), to exactly the stated
number of tokens: ``make_text(tag, n)`` is ``4·n`` bytes. A text starts with its tag
(for example the session id and turn), so different sessions' user messages differ from
their first bytes, while a tenant's system prompt depends only on the tenant name and is
byte-identical in every session of that tenant (a shared prefix for the prefix cache).

:class:`SessionPrompts` renders a session's prompts turn by turn with the emulator's chat
template and keeps the chained KV block hashes of the context it has already hashed, so
the simulator hashes each context byte once per session instead of once per turn.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

from fastroute.hardware import BLOCK_SIZE_TOKENS
from fastroute.hashing import key_hash
from fastroute.tokens import BYTES_PER_TOKEN, TokenizedPrompt, render_chat

__all__ = [
    "Turn",
    "Session",
    "SessionPrompts",
    "make_text",
    "system_prompt_text",
    "reply_text",
    "CHAT_OVERHEAD_TOKENS",
]

# Filler corpus: varied words so text looks like text; any ASCII works for the emulator.
_CORPUS = (
    "the quick brown fox jumps over the lazy dog while a router weighs every engine "
    "by its latency and load and keeps each session close to its cached prefix so that "
    "long conversations do not pay for their history again on every turn of the chat "
    "requests arrive in bursts and the controller solves a small linear program each "
    "period to spread demand across regions without moving sessions more than needed "
)
_CORPUS_X = _CORPUS * 64  # long enough to slice any offset + 4 KiB without wrapping
_BLOCK_BYTES = BYTES_PER_TOKEN * BLOCK_SIZE_TOKENS

_BOS = "<|begin_of_text|>"
_EOT = "<|eot_id|>"
_ASSISTANT = "<|start_header_id|>assistant<|end_header_id|>\n\n"

#: Tokens the chat template adds around a single user message (no system prompt).
CHAT_OVERHEAD_TOKENS = -(-len(render_chat([{"role": "user", "content": ""}])) // BYTES_PER_TOKEN)


def _offset(tag: str) -> int:
    digest = hashlib.blake2b(tag.encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % len(_CORPUS)


def make_text(tag: str, num_tokens: int) -> str:
    """ASCII text of exactly ``num_tokens`` tokens (``4·num_tokens`` bytes) starting with ``tag``.

    Parameters
    ----------
    tag : str
        ASCII prefix that makes the text unique (truncated if longer than the text).
    num_tokens : int
        Length in tokens, ≥ 0.
    """
    n = num_tokens * BYTES_PER_TOKEN
    head = f"[{tag}] "
    if len(head) >= n:
        return head[:n]
    need = n - len(head)
    start = _offset(tag)
    if need <= len(_CORPUS_X) - start:
        return head + _CORPUS_X[start : start + need]
    reps = need // len(_CORPUS) + 2
    return head + (_CORPUS * reps)[start : start + need]


def system_prompt_text(tenant: str, num_tokens: int) -> str:
    """The system prompt of ``tenant``: the same bytes for every session of the tenant."""
    return make_text(f"system prompt of tenant {tenant}", num_tokens)


def reply_text(session_id: str, turn: int, num_tokens: int) -> str:
    """A synthetic assistant reply of ``num_tokens`` tokens (the simulator's stand-in)."""
    return make_text(f"reply {session_id}/{turn}", num_tokens)


class Turn(msgspec.Struct, frozen=True, kw_only=True):
    """One user turn of a session.

    Attributes
    ----------
    user_text : str
        The new user message (exactly ``user_tokens`` tokens).
    user_tokens : int
        Tokens of ``user_text``.
    max_tokens : int
        ``max_tokens`` of the request (the simulator generates exactly this many).
    think_s : float
        Pause between the previous reply and this turn (0 for the first turn).
    """

    user_text: str
    user_tokens: int
    max_tokens: int
    think_s: float = 0.0


class Session(msgspec.Struct, frozen=True, kw_only=True):
    """A conversation: a tenant's system prompt, then user turns sent one after the other.

    Attributes
    ----------
    session_id : str
        Unique, stable id (the routing key of session-affinity policies).
    tenant, source, model : str
        Tenant, source cluster (region) and model name.
    start_s : float
        When the first turn is sent, seconds from the start of the run.
    system_prompt : str
        Shared per tenant; empty for none.
    turns : tuple of Turn
        At least one turn.
    prompt_tokens_hint : tuple of int
        Optional: full prompt tokens per turn as recorded in a trace (empty if unknown).
    """

    session_id: str
    tenant: str
    source: str
    model: str
    start_s: float
    system_prompt: str
    turns: tuple[Turn, ...]
    prompt_tokens_hint: tuple[int, ...] = ()

    def messages(self, turn: int, replies: Sequence[str]) -> list[dict[str, str]]:
        """OpenAI chat messages through turn ``turn``'s user message.

        Parameters
        ----------
        turn : int
            Index into :attr:`turns`.
        replies : sequence of str
            Assistant texts of turns ``0 .. turn-1`` (at least ``turn`` of them).

        Returns
        -------
        list of dict
            The system message (if any), then for each earlier turn the user text and
            ``replies[i]`` as the assistant text, then the user text of ``turn``.

        Raises
        ------
        IndexError
            ``turn`` out of range or fewer than ``turn`` replies.
        """
        if not 0 <= turn < len(self.turns):
            raise IndexError(f"session {self.session_id} has {len(self.turns)} turns, not {turn}")
        if len(replies) < turn:
            raise IndexError(f"turn {turn} needs {turn} earlier replies, got {len(replies)}")
        out: list[dict[str, str]] = []
        if self.system_prompt:
            out.append({"role": "system", "content": self.system_prompt})
        for i in range(turn):
            out.append({"role": "user", "content": self.turns[i].user_text})
            out.append({"role": "assistant", "content": replies[i]})
        out.append({"role": "user", "content": self.turns[turn].user_text})
        return out


def _part(role: str, content: str) -> str:
    return f"<|start_header_id|>{role}<|end_header_id|>\n\n{content}{_EOT}"


class SessionPrompts:
    """A session's prompts, rendered as the emulator renders them, with incremental hashing.

    ``prompt(i)`` equals ``tokenize_text(render_chat(session.messages(i, replies)))``;
    call :meth:`add_reply` after turn ``i`` completes, before ``prompt(i + 1)``.

    Parameters
    ----------
    session : Session
    """

    __slots__ = ("session", "_context", "_hashes", "_prev", "_turn")

    def __init__(self, session: Session) -> None:
        self.session = session
        ctx = _BOS
        if session.system_prompt:
            ctx += _part("system", session.system_prompt)
        self._context = ctx  # rendered text of everything before the next user message
        self._hashes: list[int] = []  # hashes of blocks made only of real (unpadded) bytes
        self._prev = 0
        self._turn = 0

    @property
    def next_turn(self) -> int:
        """The turn :meth:`prompt` renders next."""
        return self._turn

    def text(self, turn: int) -> str:
        """Prompt text of ``turn`` (must be :attr:`next_turn`)."""
        if turn != self._turn:
            raise ValueError(f"prompt of turn {turn} asked, next turn is {self._turn}")
        return self._context + _part("user", self.session.turns[turn].user_text) + _ASSISTANT

    def prompt(self, turn: int) -> TokenizedPrompt:
        """Token count and chained block hashes of ``turn``'s prompt."""
        data = self.text(turn).encode("utf-8")
        num_tokens = -(-len(data) // BYTES_PER_TOKEN)
        num_full = num_tokens // BLOCK_SIZE_TOKENS
        hashes = self._hashes
        prev = self._prev
        # Extend the cache with blocks entirely made of real bytes (valid for later turns).
        real_full = len(data) // _BLOCK_BYTES
        for i in range(len(hashes), real_full):
            prev = key_hash(
                prev.to_bytes(8, "little") + data[i * _BLOCK_BYTES : (i + 1) * _BLOCK_BYTES]
            )
            hashes.append(prev)
        self._prev = prev
        if num_full > real_full:
            # The last full block ends in a zero-padded token: hash it for this prompt only.
            block = data[real_full * _BLOCK_BYTES :].ljust(_BLOCK_BYTES, b"\0")
            tail = key_hash(prev.to_bytes(8, "little") + block)
            return TokenizedPrompt(num_tokens, (*hashes[: num_full - 1], tail))
        return TokenizedPrompt(num_tokens, tuple(hashes[:num_full]))

    def add_reply(self, turn: int, reply: str) -> None:
        """Append turn ``turn``'s user message and ``reply`` to the context."""
        if turn != self._turn:
            raise ValueError(f"reply of turn {turn} added, next turn is {self._turn}")
        self._context += _part("user", self.session.turns[turn].user_text) + _part(
            "assistant", reply
        )
        self._turn += 1
