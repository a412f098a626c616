"""The emulator's generated text: deterministic words."""

from __future__ import annotations

from fastroute.emulator.output_text import WORDS, output_token_text


def test_output_text_is_deterministic_words():
    """Generated token j of seed s is a fixed vocabulary word."""
    assert output_token_text(7, 3) == output_token_text(7, 3)
    assert all(output_token_text(1, j) in WORDS for j in range(50))
    assert len({output_token_text(1, j) for j in range(50)}) > 10
