"""Tokenizer approximation: deterministic counts, shared prefixes share blocks."""

from __future__ import annotations

import struct

import pytest

from fastroute.tokens import (
    count_text_tokens,
    render_chat,
    text_token_ids,
    token_ids_text,
    tokenize_ids,
    tokenize_text,
)


def test_counts_are_ceil_of_utf8_bytes_over_four():
    """Four UTF-8 bytes per token, rounded up; multi-byte characters count by bytes."""
    assert count_text_tokens("") == 0
    assert count_text_tokens("abcd") == 1
    assert count_text_tokens("abcde") == 2
    assert count_text_tokens("é" * 4) == 2  # 8 bytes
    assert tokenize_text("x" * 65).num_tokens == 17


def test_only_full_blocks_are_hashed():
    """63 bytes = 16 tokens = one full block; 60 bytes = 15 tokens = none."""
    assert len(tokenize_text("a" * 63).block_hashes) == 1
    assert tokenize_text("a" * 60).block_hashes == ()


def test_shared_prefix_shares_leading_blocks(rand):
    """Two prompts with a common 640-byte prefix share exactly its 10 block hashes."""
    prefix = "".join(rand.choice("abcdefgh ") for _ in range(640))
    a = tokenize_text(prefix + "first question about routing? " * 3)
    b = tokenize_text(prefix + "a different question entirely. " * 3)
    assert len(a.block_hashes) == len(b.block_hashes) == 11
    assert a.block_hashes[:10] == b.block_hashes[:10]
    assert a.block_hashes[10] != b.block_hashes[10]


def test_chained_hash_depends_on_everything_before():
    """Same block content after a different prefix gets a different hash."""
    a = tokenize_text("A" * 64 + "B" * 64)
    b = tokenize_text("C" * 64 + "B" * 64)
    assert a.block_hashes[1] != b.block_hashes[1]


def test_token_ids_of_a_text_hash_like_the_text():
    """A list of ids equal to the 4-byte chunking of a text has the same block hashes."""
    text = "routing " * 40  # 320 bytes, 80 tokens, 5 blocks
    ids = list(struct.unpack(f"<{len(text) // 4}I", text.encode()))
    assert tokenize_ids(ids) == tokenize_text(text)


def test_invalid_token_ids_are_rejected():
    """Negative, too large or non-integer ids raise ValueError."""
    for bad in ([-1], [2**32], [1.5], ["a"], [True]):
        with pytest.raises(ValueError):
            tokenize_ids(bad)


def test_chat_template_renders_roles_and_generation_prompt():
    """Llama-3-style headers per message, ending with the assistant header."""
    text = render_chat(
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]},
        ]
    )
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nbe brief<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_chat_template_continues_the_final_message():
    """``continue_final_message`` leaves the last turn open and adds no generation prompt:
    the prompt is the whole one plus the partial reply, so its blocks are shared."""
    messages = [{"role": "user", "content": "hi"}]
    partial = [*messages, {"role": "assistant", "content": " the of"}]
    text = render_chat(partial, add_generation_prompt=False, continue_final_message=True)
    assert text == render_chat(messages) + " the of"


def test_chat_template_rejects_malformed_messages():
    """A message without a string role is a ValueError (the server's 400)."""
    with pytest.raises(ValueError):
        render_chat([{"content": "no role"}])
    with pytest.raises(ValueError):
        render_chat(["just a string"])


def test_conversation_turns_share_their_history_blocks():
    """Turn 2 of a chat starts with turn 1's prompt, so it reuses its full blocks."""
    history = [{"role": "system", "content": "You are helpful. " * 20}]
    turn1 = history + [{"role": "user", "content": "first question " * 10}]
    turn2 = turn1 + [
        {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": "follow up"},
    ]
    t1, t2 = tokenize_text(render_chat(turn1)), tokenize_text(render_chat(turn2))
    shared = len(render_chat(turn1)[: -len("<|start_header_id|>assistant<|end_header_id|>\n\n")])
    assert t2.block_hashes[: shared // 64] == t1.block_hashes[: shared // 64]


@pytest.mark.parametrize("text", ["", "a", "hello wörld", "x" * 1000, "日本語のテキスト"])
def test_text_token_ids_round_trip_and_agree_with_counting(text: str) -> None:
    ids = text_token_ids(text)
    assert len(ids) == count_text_tokens(text)
    assert tokenize_ids(ids) == tokenize_text(text)
    assert token_ids_text(ids) == text


def test_token_ids_text_rejects_out_of_range_ids() -> None:
    with pytest.raises(ValueError, match="token ids"):
        token_ids_text([2**32])
