"""Replay request traces as sessions (schema in docs/simulator.md, "Trace replay").

Accepted files (detected from the header / first record):

* **Azure LLM inference CSV** — ``TIMESTAMP, ContextTokens, GeneratedTokens``;
* **Mooncake JSONL** — ``timestamp`` (ms), ``input_length``, ``output_length``,
  ``hash_ids`` (one id per 512-token block; equal ids = equal text);
* **generic CSV or JSONL** — ``timestamp_s``, ``prompt_tokens``, ``output_tokens`` and,
  optionally, ``session_id``, ``tenant``, ``source``, ``model``, ``hash_ids`` (JSONL).

Every row becomes one request whose *rendered* prompt (chat template included) has the
row's prompt tokens under the emulator's 4-byte rule, and whose ``max_tokens`` is the
row's output tokens. Rows without a ``session_id`` are single-turn sessions; rows sharing
one become the turns of one session (their prompt tokens are then the *new* user tokens
of each turn, and the gap between their timestamps is used as the think time).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from fastroute.tokens import BYTES_PER_TOKEN
from fastroute.workload.blocks import BLOCK_TOKENS, BlockTexts
from fastroute.workload.session import CHAT_OVERHEAD_TOKENS, Session, Turn, make_text
from fastroute.workload.spec import WorkloadError

__all__ = ["load_trace", "TraceRow", "MOONCAKE_BLOCK_TOKENS"]

#: Tokens per Mooncake ``hash_ids`` block.
MOONCAKE_BLOCK_TOKENS = BLOCK_TOKENS


class TraceRow:
    """One parsed trace record (times in seconds from the trace's own origin)."""

    __slots__ = (
        "t_s",
        "prompt_tokens",
        "output_tokens",
        "session_id",
        "tenant",
        "source",
        "model",
        "hash_ids",
    )

    def __init__(
        self,
        t_s: float,
        prompt_tokens: int,
        output_tokens: int,
        *,
        session_id: str | None = None,
        tenant: str | None = None,
        source: str | None = None,
        model: str | None = None,
        hash_ids: Sequence[int] = (),
    ) -> None:
        self.t_s = t_s
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.session_id = session_id
        self.tenant = tenant
        self.source = source
        self.model = model
        self.hash_ids = tuple(hash_ids)


def _azure_time(value: str) -> float:
    # "2023-11-16 18:17:03.9799600": 7 fractional digits, more than strptime's %f takes.
    base, _, frac = value.strip().partition(".")
    stamp = datetime.strptime(base, "%Y-%m-%d %H:%M:%S").timestamp()
    return stamp + (float("0." + frac) if frac else 0.0)


def _int(row: dict[str, Any], key: str, where: str) -> int:
    try:
        value = int(row[key])
    except KeyError:
        raise WorkloadError(f"{where}: missing field {key!r}") from None
    except (TypeError, ValueError):
        raise WorkloadError(
            f"{where}: field {key!r} must be an integer, got {row[key]!r}"
        ) from None
    if value < 0:
        raise WorkloadError(f"{where}: field {key!r} must be >= 0, got {value}")
    return value


def _float(row: dict[str, Any], key: str, where: str) -> float:
    try:
        return float(row[key])
    except KeyError:
        raise WorkloadError(f"{where}: missing field {key!r}") from None
    except (TypeError, ValueError):
        raise WorkloadError(f"{where}: field {key!r} must be a number, got {row[key]!r}") from None


def _opt(row: dict[str, Any], key: str) -> str | None:
    value = row.get(key)
    return None if value in (None, "") else str(value)


def _hash_ids(row: dict[str, Any], where: str) -> tuple[int, ...]:
    ids = row.get("hash_ids") or ()
    if not isinstance(ids, list | tuple) or not all(type(h) is int for h in ids):
        raise WorkloadError(f"{where}: hash_ids must be a list of integers")
    return tuple(ids)


def _parse_row(row: dict[str, Any], where: str) -> TraceRow:
    if "TIMESTAMP" in row:  # Azure
        try:
            t_s = _azure_time(str(row["TIMESTAMP"]))
        except ValueError:
            raise WorkloadError(f"{where}: bad TIMESTAMP {row['TIMESTAMP']!r}") from None
        return TraceRow(t_s, _int(row, "ContextTokens", where), _int(row, "GeneratedTokens", where))
    if "input_length" in row:  # Mooncake
        t_s = _float(row, "timestamp", where) / 1000.0
        n_in, n_out = _int(row, "input_length", where), _int(row, "output_length", where)
        return TraceRow(t_s, n_in, n_out, hash_ids=_hash_ids(row, where))
    if "timestamp_s" in row:  # generic
        return TraceRow(
            _float(row, "timestamp_s", where),
            _int(row, "prompt_tokens", where),
            _int(row, "output_tokens", where),
            session_id=_opt(row, "session_id"),
            tenant=_opt(row, "tenant"),
            source=_opt(row, "source"),
            model=_opt(row, "model"),
            hash_ids=_hash_ids(row, where),
        )
    raise WorkloadError(
        f"{where}: unrecognised record with fields {sorted(row)}; expected Azure "
        "(TIMESTAMP, ContextTokens, GeneratedTokens), Mooncake (timestamp, input_length, "
        "output_length, hash_ids) or generic (timestamp_s, prompt_tokens, output_tokens)"
    )


def _records(path: Path) -> Iterator[tuple[dict[str, Any], str]]:
    with path.open(encoding="utf-8", newline="") as fh:
        first = fh.read(1)
        fh.seek(0)
        if first == "{":
            for lineno, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise WorkloadError(f"{path}:{lineno}: invalid JSON: {exc.msg}") from None
                    if not isinstance(rec, dict):
                        raise WorkloadError(f"{path}:{lineno}: each line must be a JSON object")
                    yield rec, f"{path}:{lineno}"
        else:
            for lineno, rec in enumerate(csv.DictReader(fh), 2):
                yield {k.strip(): v for k, v in rec.items() if k is not None}, f"{path}:{lineno}"


def load_trace(
    path: str | Path,
    *,
    limit: int | None = None,
    time_scale: float = 1.0,
    sources: Sequence[str] = ("local",),
    model: str = "demo-8b",
    tenant: str = "trace",
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> list[Session]:
    """Read a trace into sessions sorted by start time (the first record at ``t = 0``).

    Parameters
    ----------
    path : str or Path
        CSV or JSONL file (see the module docstring).
    limit : int, optional
        Read at most this many records.
    time_scale : float
        Multiply inter-arrival times by this (0.5 = replay twice as fast), > 0.
    sources : sequence of str
        Source regions assigned round-robin to records that name none.
    model, tenant : str
        Defaults for records that name none.
    block_tokens : int
        Tokens per ``hash_ids`` block (Mooncake: 512).

    Returns
    -------
    list of Session
        Ids ``"trace-{index:06d}"`` (or the trace's ``session_id``).

    Raises
    ------
    WorkloadError
        Missing file, unrecognised or malformed records (file and line in the message).
    """
    path = Path(path)
    if not path.is_file():
        raise WorkloadError(f"trace file not found: {path}")
    if not time_scale > 0:
        raise WorkloadError(f"time_scale must be > 0, got {time_scale}")
    if not sources:
        raise WorkloadError("sources must not be empty")
    rows: list[TraceRow] = []
    for rec, where in _records(path):
        if limit is not None and len(rows) >= limit:
            break
        rows.append(_parse_row(rec, where))
    if not rows:
        return []
    t0 = min(r.t_s for r in rows)
    groups: dict[str, list[TraceRow]] = {}
    order: list[str] = []
    for index, row in enumerate(rows):
        sid = row.session_id or f"trace-{index:06d}"
        if sid not in groups:
            groups[sid] = []
            order.append(sid)
        groups[sid].append(row)
    blocks = BlockTexts("block", block_tokens)
    sessions = []
    for index, sid in enumerate(order):
        members = sorted(groups[sid], key=lambda r: r.t_s)
        head = members[0]
        turns = []
        for i, row in enumerate(members):
            if len(members) == 1:
                # A single request: its whole rendered prompt has the row's token count.
                user_tokens = max(1, row.prompt_tokens - CHAT_OVERHEAD_TOKENS)
            else:
                user_tokens = max(1, row.prompt_tokens)
            if row.hash_ids:
                text = blocks.join(row.hash_ids)
                n_bytes = user_tokens * BYTES_PER_TOKEN
                if len(text) < n_bytes:
                    text += make_text(f"{sid} tail {i}", user_tokens - len(text) // BYTES_PER_TOKEN)
                text = text[:n_bytes]
            else:
                text = make_text(f"{sid} turn {i}", user_tokens)
            think = 0.0 if i == 0 else (row.t_s - members[i - 1].t_s) * time_scale
            turns.append(
                Turn(
                    user_text=text,
                    user_tokens=user_tokens,
                    max_tokens=max(1, row.output_tokens),
                    think_s=think,
                )
            )
        sessions.append(
            Session(
                session_id=sid,
                tenant=head.tenant or tenant,
                source=head.source or sources[index % len(sources)],
                model=head.model or model,
                start_s=(head.t_s - t0) * time_scale,
                system_prompt="",
                turns=tuple(turns),
                prompt_tokens_hint=tuple(r.prompt_tokens for r in members),
            )
        )
    sessions.sort(key=lambda s: (s.start_s, s.session_id))
    return sessions
