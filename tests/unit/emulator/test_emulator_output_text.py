"""The emulator's generated text: deterministic words."""

from __future__ import annotations

import msgspec
import pytest

from fastroute.emulator.output_text import WORDS, OutputText, continued_output, output_token_text
from fastroute.hashing import key_hash


def test_output_text_is_deterministic_words():
    """Generated token j of seed s is a fixed vocabulary word."""
    assert output_token_text(7, 3) == output_token_text(7, 3)
    assert all(output_token_text(1, j) in WORDS for j in range(50))
    assert len({output_token_text(1, j) for j in range(50)}) > 10


def _seed_of(text: str) -> int:
    return key_hash(text) & 0xFFFFFFFF


def _text(output: OutputText, start: int, stop: int) -> str:
    return "".join(output.token(i) for i in range(start, stop))


@pytest.mark.parametrize("done", [1, 2, 5, 17])
def test_a_completions_continuation_goes_on_where_the_output_stopped(done: int) -> None:
    """Prompt + the first ``done`` tokens: the rest of the same output, whatever its length."""
    prompt = "Once upon a time"
    whole = OutputText(_seed_of(prompt))
    got = continued_output(prompt + _text(whole, 0, done), _seed_of)
    assert got == OutputText(whole.seed, done)
    assert _text(whole, 0, done) + _text(got, 0, 30 - done) == _text(whole, 0, 30)


def test_a_prompt_without_an_earlier_output_starts_a_fresh_one() -> None:
    """(A prompt ending in vocabulary words reads as a continuation when its last words
    happen to be what the prompt before them generates: about 1 in 100 such prompts.)"""
    for prompt in ("Once upon a time", "", " the", "x the of", "a story about the sea"):
        assert continued_output(prompt, _seed_of) == OutputText(_seed_of(prompt))


def test_a_prompt_of_vocabulary_words_continues_its_own_output() -> None:
    """A prompt that itself ends in vocabulary words: the split is still exact."""
    prompt = "and the" + "".join(WORDS[:5])
    whole = OutputText(_seed_of(prompt))
    got = continued_output(prompt + _text(whole, 0, 3), _seed_of)
    assert _text(got, 0, 4) == _text(whole, 3, 7)


def test_output_text_offsets_the_index() -> None:
    assert OutputText(9, 4).token(2) == output_token_text(9, 6)


def test_the_emulator_continues_a_partial_assistant_turn() -> None:
    """A chat continuation is seeded like the request without the partial turn and starts
    at its word count; a plain request is seeded by its prompt (the same on every engine)."""
    from fastroute.emulator.protocol import decode_chat, decode_completion
    from fastroute.emulator.server import _output_text

    messages = [{"role": "user", "content": "hi"}]
    whole = _output_text(decode_chat(msgspec.json.encode({"messages": messages})), True)
    assert whole == _output_text(decode_chat(msgspec.json.encode({"messages": messages})), True)
    partial = _text(whole, 0, 3)
    body = {
        "messages": [*messages, {"role": "assistant", "content": partial}],
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    assert _output_text(decode_chat(msgspec.json.encode(body)), True) == OutputText(whole.seed, 3)
    completion = _output_text(decode_completion(b'{"prompt": "Once"}'), False)
    continued = decode_completion(msgspec.json.encode({"prompt": "Once" + _text(completion, 0, 2)}))
    assert _output_text(continued, False) == OutputText(completion.seed, 2)
