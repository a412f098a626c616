"""Session text, chat messages and incremental prompt hashing."""

from __future__ import annotations

import pytest

from fastroute.tokens import count_text_tokens, render_chat, tokenize_text
from fastroute.workload import (
    ChatWorkload,
    Session,
    SessionPrompts,
    TenantMix,
    Turn,
    generate_sessions,
)
from fastroute.workload.session import CHAT_OVERHEAD_TOKENS, make_text, reply_text


@pytest.mark.parametrize("n", [0, 1, 2, 3, 17, 500, 3000])
def test_make_text_has_exactly_the_token_count(n):
    """make_text(tag, n) is 4n ASCII bytes: n tokens under the emulator's rule."""
    text = make_text("session 12 turn 3", n)
    assert len(text.encode()) == 4 * n == len(text)
    assert count_text_tokens(text) == n


def test_chat_overhead_is_whole_tokens():
    """The template around one user message adds a whole number of tokens."""
    assert count_text_tokens(render_chat([{"role": "user", "content": ""}])) == CHAT_OVERHEAD_TOKENS
    assert count_text_tokens(render_chat([{"role": "user", "content": make_text("x", 10)}])) == (
        CHAT_OVERHEAD_TOKENS + 10
    )


def _session() -> Session:
    turns = tuple(
        Turn(
            user_text=make_text(f"s turn {i}", 20 + 7 * i), user_tokens=20 + 7 * i, max_tokens=5 + i
        )
        for i in range(4)
    )
    return Session(
        session_id="s",
        tenant="t",
        source="r",
        model="m",
        start_s=0.0,
        system_prompt=make_text("sys", 33),
        turns=turns,
    )


def test_messages_carry_the_whole_previous_context():
    """messages(i) = system, (user_j, reply_j) for j < i, then user_i."""
    s = _session()
    msgs = s.messages(2, ["r0", "r1"])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in msgs[1:]] == [
        s.turns[0].user_text,
        "r0",
        s.turns[1].user_text,
        "r1",
        s.turns[2].user_text,
    ]
    with pytest.raises(IndexError):
        s.messages(2, ["r0"])
    with pytest.raises(IndexError):
        s.messages(4, ["r"] * 4)


def test_session_prompts_match_the_emulator_tokenizer_turn_by_turn():
    """SessionPrompts.prompt(i) equals tokenize_text(render_chat(messages(i))) for every turn
    of generated sessions (odd byte offsets and padded last tokens included)."""
    w = ChatWorkload(
        rate_sessions_per_s=2.0, mean_turns=5.0, tenants=(TenantMix(system_prompt_tokens=37),)
    )
    checked = 0
    for s in generate_sessions(w, duration_s=20.0, seed=3)[:8]:
        prompts = SessionPrompts(s)
        replies: list[str] = []
        for i, turn in enumerate(s.turns):
            got = prompts.prompt(i)
            assert got == tokenize_text(render_chat(s.messages(i, replies)))
            reply = reply_text(s.session_id, i, turn.max_tokens) + "é"[: i % 2]  # non-4-byte tail
            replies.append(reply)
            prompts.add_reply(i, reply)
            checked += 1
    assert checked >= 8


def test_session_prompts_reject_out_of_order_turns():
    """Prompts are rendered in turn order; asking ahead is an error, not a wrong prompt."""
    prompts = SessionPrompts(_session())
    with pytest.raises(ValueError, match="next turn is 0"):
        prompts.prompt(1)
