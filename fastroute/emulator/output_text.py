"""Generated text: a deterministic sequence of short words.

Token ``j`` of an output seeded ``s`` is ``WORDS[(s + j·2654435761) mod len(WORDS)]``.
"""

from __future__ import annotations

__all__ = ["WORDS", "output_token_text"]

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
