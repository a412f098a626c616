"""load_trace: Azure CSV, Mooncake JSONL and the generic schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastroute.tokens import count_text_tokens, render_chat, tokenize_text
from fastroute.workload import WorkloadError, load_trace

SHARED = Path(__file__).resolve().parents[4] / "shared" / "traces"


def _prompt_tokens(session, turn=0, replies=()):
    return count_text_tokens(render_chat(session.messages(turn, list(replies))))


def test_azure_csv_rows_become_single_turn_sessions(tmp_path):
    """Times relative to the first row (7-digit fractions), rendered prompt = ContextTokens."""
    p = tmp_path / "azure.csv"
    p.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
        "2023-11-16 18:15:46.6805900,374,44\r\n"
        "2023-11-16 18:15:50.9951690,396,109\r\n"
        "2023-11-16 18:15:47.0000000,1000,1\r\n"
    )
    sessions = load_trace(p, sources=("eu", "us"))
    assert [s.start_s for s in sessions] == pytest.approx([0.0, 0.31941, 4.314579])
    assert [_prompt_tokens(s) for s in sessions] == [374, 1000, 396]
    assert [s.turns[0].max_tokens for s in sessions] == [44, 1, 109]
    assert {s.source for s in sessions} == {"eu", "us"}


def test_mooncake_equal_hash_ids_share_exact_prefix_blocks(tmp_path):
    """Two records sharing their first 2 of 3 hash ids share the KV blocks of that prefix."""
    p = tmp_path / "mc.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1400, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 1500, "input_length": 1300, "output_length": 7, "hash_ids": [1, 2, 4]},
    ]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    a, b = load_trace(p, time_scale=2.0)
    assert b.start_s == pytest.approx(3.0)
    assert _prompt_tokens(a) == 1400 and _prompt_tokens(b) == 1300
    ha = tokenize_text(render_chat(a.messages(0, []))).block_hashes
    hb = tokenize_text(render_chat(b.messages(0, []))).block_hashes
    shared = sum(1 for x, y in zip(ha, hb, strict=False) if x == y)
    # 1024 shared tokens of content + the template header, in 16-token blocks.
    assert 1024 // 16 - 1 <= shared <= (1024 + 15) // 16 + 1
    assert ha[shared:] and hb[shared:] and ha[shared] != hb[shared]


def test_generic_jsonl_groups_session_rows_into_turns(tmp_path):
    """Rows sharing a session_id become turns; think time = timestamp gap; fields carried."""
    p = tmp_path / "g.jsonl"
    rows = [
        {
            "timestamp_s": 10.0,
            "prompt_tokens": 50,
            "output_tokens": 9,
            "session_id": "x",
            "source": "us",
            "model": "m",
        },
        {"timestamp_s": 12.5, "prompt_tokens": 80, "output_tokens": 4},
        {"timestamp_s": 16.0, "prompt_tokens": 30, "output_tokens": 3, "session_id": "x"},
    ]
    p.write_text("\n".join(json.dumps(r) for r in rows))
    sessions = load_trace(p)
    x = next(s for s in sessions if s.session_id == "x")
    assert (x.source, x.model, x.start_s) == ("us", "m", 0.0)
    assert [t.user_tokens for t in x.turns] == [50, 30] and x.turns[1].think_s == pytest.approx(6.0)
    other = next(s for s in sessions if s.session_id != "x")
    assert other.start_s == pytest.approx(2.5) and _prompt_tokens(other) == 80


def test_generic_csv_and_limit(tmp_path):
    """Generic CSV columns are accepted and limit stops reading."""
    p = tmp_path / "g.csv"
    p.write_text("timestamp_s,prompt_tokens,output_tokens\n0,100,5\n1,200,6\n2,300,7\n")
    sessions = load_trace(p, limit=2)
    assert [_prompt_tokens(s) for s in sessions] == [100, 200]


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("a,b\n1,2\n", "unrecognised record"),
        ("timestamp_s,prompt_tokens,output_tokens\n0,x,5\n", "must be an integer"),
        ('{"timestamp": 0, "input_length": 5}\n', "missing field 'output_length'"),
        ('{"timestamp": 0\n', "invalid JSON"),
    ],
)
def test_malformed_traces_name_file_and_line(tmp_path, content, fragment):
    """Malformed records raise WorkloadError with the file:line and the reason."""
    p = tmp_path / "bad.txt"
    p.write_text(content)
    with pytest.raises(WorkloadError, match=fragment) as info:
        load_trace(p)
    assert str(p) in str(info.value)


def test_missing_file():
    """A missing trace is a clear error."""
    with pytest.raises(WorkloadError, match="not found"):
        load_trace("/nonexistent/trace.csv")


@pytest.mark.skipif(not SHARED.is_dir(), reason="shared traces not present")
def test_shipped_traces_load():
    """The three shipped traces load (first 500 records) with their token counts."""
    for name in (
        "azure-llm-2023-conv.csv",
        "azure-llm-2023-code.csv",
        "mooncake-fast25-synthetic.jsonl",
    ):
        sessions = load_trace(SHARED / name, limit=500)
        assert len(sessions) == 500
        assert all(
            _prompt_tokens(s)
            == max(s.prompt_tokens_hint[0], _prompt_tokens(s) - s.turns[0].user_tokens + 1)
            for s in sessions
        )
