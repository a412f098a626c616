"""Small Azure-format LLM traces for tests (the format of ``../shared/traces``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

__all__ = ["write_azure_csv"]


def write_azure_csv(
    path: Path,
    rows: int,
    *,
    gap_s: float = 0.2,
    prompt: int | Callable[[int], int] = lambda i: 10 + (i * 397) % 1201,
    out: int | Callable[[int], int] = lambda i: 2 + (i * 7) % 40,
) -> Path:
    """Write ``rows`` records ``gap_s`` apart; ``prompt`` and ``out`` are token counts, fixed
    or by record index (default: prompts of 10–1210 tokens, outputs of 2–41). Returns ``path``."""
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(rows):
        t = i * gap_s
        p = prompt(i) if callable(prompt) else prompt
        o = out(i) if callable(out) else out
        lines.append(f"2023-11-16 18:{int(t // 60):02d}:{t % 60:010.7f},{p},{o}")
    path.write_text("\n".join(lines) + "\n")
    return path
