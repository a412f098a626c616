"""Request shapes of a workload: (prompt tokens, output tokens) pairs, for capacity estimates."""

from __future__ import annotations

import random
from collections.abc import Sequence

from fastroute.workload.session import Session

__all__ = ["request_shapes"]

# Template tokens per message (header + end-of-turn), close enough for shapes.
_MESSAGE_OVERHEAD_TOKENS = 10


def request_shapes(sessions: Sequence[Session], n: int, seed: int = 0) -> list[tuple[int, int]]:
    """Sample ``n`` (prompt tokens, output tokens) pairs of the sessions' requests.

    Each turn's prompt includes the whole previous context (replies at ``max_tokens``).
    """
    shapes: list[tuple[int, int]] = []
    for s in sessions:
        ctx = len(s.system_prompt) // 4 + (_MESSAGE_OVERHEAD_TOKENS if s.system_prompt else 5)
        for t in s.turns:
            prompt = ctx + t.user_tokens + 2 * _MESSAGE_OVERHEAD_TOKENS
            shapes.append((prompt, t.max_tokens))
            ctx = prompt + t.max_tokens
    if not shapes:
        return []
    rng = random.Random(seed)
    return [shapes[rng.randrange(len(shapes))] for _ in range(n)]
