"""Generated text: a deterministic sequence of short words.

Token ``j`` of an output seeded ``s`` is ``WORDS[(s + j·2654435761) mod len(WORDS)]``.
An output may start at a later token (:class:`OutputText`): a continuation of a partial
output (a migrated stream) goes on where the partial one stopped, so the segments
concatenated are the output one engine would have produced
(:func:`continued_output`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from fastroute.hashing import key_hash
from fastroute.tokens import render_chat

__all__ = [
    "WORDS", "output_token_text", "OutputText", "continued_output", "prompt_seed", "chat_output",
]  # fmt: skip

#: Vocabulary of generated text: short English words, each one token.
WORDS: tuple[str, ...] = tuple(
    " " + w
    for w in (
        "the of and to in is that for it as was with be by on not he this are or his "
        "from at which but have an they you were her she there been one all we their "
        "has would when if so no will can more other its time into only some could new "
        "them than then two may these first any like now my such make over our even most"
    ).split()
)


def output_token_text(seed: int, index: int) -> str:
    """Return the text of generated token ``index`` of an output seeded ``seed``."""
    return WORDS[(seed + index * 2654435761) % len(WORDS)]


#: The step between the vocabulary positions of consecutive tokens of one output.
_STEP = 2654435761
_POSITION = {w: i for i, w in enumerate(WORDS)}
#: Split points of a prompt's generated-looking suffix that :func:`continued_output` tries
#: (from the longest): a run of vocabulary words only rarely extends a real one by chance.
MAX_SPLIT_CANDIDATES = 8
#: Most trailing words of a prompt looked at as a possible earlier output.
MAX_CONTINUED_TOKENS = 1 << 16


@dataclass(frozen=True, slots=True)
class OutputText:
    """The text of one output: token ``i`` is token ``first_index + i`` of ``seed``'s."""

    seed: int
    first_index: int = 0

    def token(self, index: int) -> str:
        """The text of this output's token ``index``."""
        return output_token_text(self.seed, self.first_index + index)


def _trailing_run(prompt: str) -> list[int]:
    """Start offsets of the prompt's trailing tokens that follow one output's sequence
    (each is a vocabulary word after the one before it), from the last one back."""
    starts: list[int] = []
    end = len(prompt)
    after: int | None = None  # vocabulary position of the token after this one
    while len(starts) < MAX_CONTINUED_TOKENS:
        start = prompt.rfind(" ", 0, end)
        if start < 0:
            break
        position = _POSITION.get(prompt[start:end])
        if position is None:
            break
        if after is not None and (position + _STEP) % len(WORDS) != after:
            break
        starts.append(start)
        after, end = position, start
    return starts


def continued_output(prompt: str, seed_of: Callable[[str], int]) -> OutputText:
    """The output of a completions ``prompt`` that may end with an earlier output of
    this emulator (a migrated stream's continuation: the prompt plus the text so far).

    The prompt is split where the longest run of trailing tokens is exactly the start
    of what ``seed_of(the prompt before it)`` generates; the output then continues that
    one. Without such a run it is ``seed_of(prompt)``'s from its first token. (A word
    names only ``seed mod len(WORDS)``, so about one in ``len(WORDS)`` prompts that end
    in a vocabulary word reads as a continuation by chance; its output is as
    deterministic, only from a later token.)
    """
    starts = _trailing_run(prompt)
    for n_words in range(len(starts), max(len(starts) - MAX_SPLIT_CANDIDATES, 0), -1):
        start = starts[n_words - 1]
        first_end = starts[n_words - 2] if n_words > 1 else len(prompt)
        seed = seed_of(prompt[:start])
        if output_token_text(seed, 0) == prompt[start:first_end]:
            return OutputText(seed, n_words)
    return OutputText(seed_of(prompt))


def prompt_seed(text: str) -> int:
    """The output seed of a rendered prompt: the same prompt makes the same text on every
    engine."""
    return key_hash(text) & 0xFFFFFFFF


def chat_output(messages: Sequence[Mapping[str, object]]) -> OutputText:
    """The output a chat request (no continuation) makes on any engine: what a client checks
    a relayed stream against."""
    return OutputText(prompt_seed(render_chat(messages)))
