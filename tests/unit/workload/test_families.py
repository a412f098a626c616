"""Workload families: byte-exact sharing structure, determinism, rates, spec validation."""

from __future__ import annotations

import itertools
import json
import os
import re
import statistics
from pathlib import Path

import pytest

from fastroute.tokens import BYTES_PER_TOKEN
from fastroute.workload import WorkloadError, load_trace
from fastroute.workload.blocks import BLOCK_TOKENS, BlockTexts
from fastroute.workload.families import FAMILY_KINDS, family_from_dict
from fastroute.workload.family_gen import arrival_times, family_sessions
from fastroute.workload.session import SessionPrompts

REPO = Path(__file__).resolve().parents[3]
TRACE = REPO / "examples" / "traces" / "mooncake-fast25-synthetic-1000.jsonl"
BLOCK_BYTES = BLOCK_TOKENS * BYTES_PER_TOKEN


def common_prefix(a: str, b: str) -> int:
    """Length of the common prefix of two texts (block-wise, then byte-wise: fast)."""
    n, i = min(len(a), len(b)), 0
    while i + BLOCK_BYTES <= n and a[i : i + BLOCK_BYTES] == b[i : i + BLOCK_BYTES]:
        i += BLOCK_BYTES
    while i < n and a[i] == b[i]:
        i += 1
    return i


def sessions(kind: str, duration_s: float = 60.0, seed: int = 1, **fields):
    return family_sessions(
        family_from_dict({"kind": kind, **fields}),
        duration_s=duration_s,
        sources=("local",),
        seed=seed,
        base_dir=str(REPO / "examples" / "scenarios" / "families"),
    )


def test_block_texts_equal_ids_equal_bytes_and_distinct_ids_differ():
    blocks = BlockTexts("block")
    assert blocks.text(7) == BlockTexts("block").text(7)
    assert len(blocks.text(7)) == BLOCK_BYTES
    assert blocks.text(7) != blocks.text(8)
    assert blocks.join([1, 2]) == blocks.text(1) + blocks.text(2)


def _pairs_to_check(id_lists):
    """Pairs sharing a first block (grouped), plus all pairs of the first 60 rows."""
    by_first: dict[int, list[int]] = {}
    for i, ids in enumerate(id_lists):
        if ids:
            by_first.setdefault(ids[0], []).append(i)
    pairs = {p for group in by_first.values() for p in itertools.combinations(group, 2)}
    return sorted(pairs | set(itertools.combinations(range(60), 2)))


def test_mooncake_replay_shares_exactly_the_blocks_whose_ids_are_shared():
    rows = [json.loads(line) for line in TRACE.read_text().splitlines()]
    replayed = load_trace(TRACE)
    by_id = {s.session_id: s.turns[0].user_text for s in replayed}
    texts = [by_id[f"trace-{i:06d}"] for i in range(len(rows))]
    checked = {"none": 0, "some": 0}
    for i, j in _pairs_to_check([r["hash_ids"] for r in rows]):
        k = len(os.path.commonprefix([rows[i]["hash_ids"], rows[j]["hash_ids"]]))
        # Both prompts extend past the shared blocks: the next block must differ.
        if min(len(texts[i]), len(texts[j])) <= (k + 1) * BLOCK_BYTES:
            continue
        assert common_prefix(texts[i], texts[j]) // BLOCK_BYTES == k, (i, j, k)
        checked["some" if k else "none"] += 1
    assert checked["none"] > 100 and checked["some"] > 20


def test_mooncake_family_replay_shares_the_traces_blocks():
    trace = "../../traces/mooncake-fast25-synthetic-1000.jsonl"
    got = sessions("prefix-tree", duration_s=240.0, trace=trace)
    texts = [s.turns[0].user_text for s in got]
    ids = [re.findall(r"\[block (\d+)\] ", t) for t in texts]
    shared = 0
    for i, j in _pairs_to_check(ids):
        k = len(os.path.commonprefix([ids[i], ids[j]]))
        if min(len(texts[i]), len(texts[j])) > (k + 1) * BLOCK_BYTES:
            assert common_prefix(texts[i], texts[j]) // BLOCK_BYTES == k
            shared += k > 0
    assert shared > 10


def test_prefix_tree_requests_share_exactly_their_common_walk():
    got = sessions("prefix-tree", roots=2, branching=2, zipf_s=0.5)
    walks, texts = [], []
    for s in got:
        text = s.turns[0].user_text
        paths = re.findall(r"\[tree ([\d.]+)\] ", text)
        # Block i of the text is the walk's node at depth i (its id is its whole path).
        assert all(len(p.split(".")) == i + 1 for i, p in enumerate(paths))
        assert all(text[i * BLOCK_BYTES :].startswith(f"[tree {p}] ") for i, p in enumerate(paths))
        walks.append(paths[-1].split(".") if paths else [])
        texts.append(text)
    depths = [0, 0]  # pairs sharing one block or none, pairs sharing more
    for i, j in itertools.combinations(range(min(len(got), 200)), 2):
        k = len(os.path.commonprefix([walks[i], walks[j]]))
        n = common_prefix(texts[i], texts[j])
        if k < min(len(walks[i]), len(walks[j])):
            assert n // BLOCK_BYTES == k, (i, j, k, n)
            depths[k > 1] += 1
    assert depths[0] and depths[1]  # both shallow and deep sharing occur


def test_rag_requests_share_their_document_and_nothing_else():
    got = sessions("rag", documents=8, zipf_s=1.0)
    docs = [re.match(r"\[document (\d+)\] ", s.turns[0].user_text).group(1) for s in got]
    assert len(set(docs)) > 1
    same = other = 0
    for i, j in itertools.combinations(range(min(len(got), 150)), 2):
        a, b = got[i].turns[0].user_text, got[j].turns[0].user_text
        n = common_prefix(a, b)
        if docs[i] == docs[j]:
            doc_bytes = a.index(f"[{got[i].session_id}] ")
            # The whole document, then at most the common start of two request ids.
            assert doc_bytes <= n < doc_bytes + len(got[i].session_id) + 2
            same += 1
        else:
            assert n < len("[document ") + 4
            other += 1
    assert same and other


def test_agentic_steps_append_to_the_previous_prompt():
    got = sessions("agentic", duration_s=60.0)
    multi = [s for s in got if len(s.turns) > 2]
    assert multi
    system = {s.system_prompt for s in got}
    assert len(system) == 1 and len(system.pop()) == 2000 * BYTES_PER_TOKEN
    for s in multi[:10]:
        prompts = SessionPrompts(s)
        previous = ""
        for i, turn in enumerate(s.turns):
            text = prompts.text(i)
            assert text.startswith(previous)
            assert len(text) > len(previous) + turn.user_tokens * BYTES_PER_TOKEN - 1
            assert turn.max_tokens <= 256
            prompts.add_reply(i, f"tool call {i}")
            previous = text


def test_long_tail_is_heavy_tailed_unique_and_fits_the_context():
    for dist in ("lognormal", "pareto"):
        got = sessions("long-tail", duration_s=500.0, distribution=dist)
        tokens = [s.turns[0].user_tokens for s in got]
        assert 9_000 < statistics.mean(tokens) < 13_500
        assert statistics.mean(tokens) > 1.15 * statistics.median(tokens)
        assert max(tokens) > 3 * statistics.median(tokens)
        for s in got:
            assert s.turns[0].user_tokens + s.turns[0].max_tokens <= 32_768 - 32
        for a, b in itertools.pairwise(got[:100]):
            assert common_prefix(a.turns[0].user_text, b.turns[0].user_text) < 16


def test_hot_prompt_shares_one_system_prompt_across_tenants():
    got = sessions("hot-prompt")
    assert len({s.system_prompt for s in got}) == 1
    assert len(got[0].system_prompt) == 6000 * BYTES_PER_TOKEN
    assert len({s.tenant for s in got}) == 8
    assert len({s.turns[0].user_text for s in got}) == len(got)


@pytest.mark.parametrize("kind", FAMILY_KINDS)
def test_families_are_deterministic_from_the_seed(kind):
    a, b = sessions(kind, seed=3), sessions(kind, seed=3)
    assert a == b and a
    assert sessions(kind, seed=4) != a
    assert [s.start_s for s in a] == sorted(s.start_s for s in a)
    assert all(0 <= s.start_s < 60.0 for s in a)


@pytest.mark.parametrize("kind", ["rag", "agentic", "chat", "hot-prompt"])
def test_requests_arrive_at_rate_rps(kind):
    got = sessions(kind, duration_s=400.0, rate_rps=5.0)
    assert sum(len(s.turns) for s in got) / 400.0 == pytest.approx(5.0, rel=0.2)


def test_bursts_raise_the_rate_inside_bursts_and_keep_the_mean():
    fam = family_from_dict(
        {"kind": "rag", "burst_every_s": 60.0, "burst_s": 10.0, "burst_factor": 3.0}
    )
    import random

    times = arrival_times(fam, 20.0, 600.0, random.Random(5))
    assert len(times) / 600.0 == pytest.approx(20.0, rel=0.1)
    bins = [0] * 60
    for t in times:
        bins[int(t // 10)] += 1
    assert max(bins) > 2.2 * statistics.mean(bins)
    assert min(bins) < 0.9 * statistics.mean(bins)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({}, "missing required field `kind`"),
        ({"kind": "tree"}, "Invalid value 'tree'"),
        ({"kind": "rag", "documents": 0}, "documents must be >= 1"),
        ({"kind": "rag", "rate_rps": 0}, "rate_rps must be > 0"),
        ({"kind": "rag", "colour": 1}, "unknown field `colour`"),
        ({"kind": "prefix-tree", "branching": 0}, "branching >= 1"),
        ({"kind": "agentic", "mean_steps": 0.5}, "mean_steps >= 1"),
        ({"kind": "long-tail", "pareto_alpha": 1.0}, "pareto_alpha > 1"),
        ({"kind": "hot-prompt", "system_prompt_tokens": 40_000}, "cannot hold"),
        ({"kind": "rag", "burst_s": 30, "burst_factor": 3}, "burst_factor * burst_s"),
        ({"kind": "rag", "question_tokens": {"median": 0}}, "question_tokens needs"),
    ],
)
def test_spec_validation_errors_name_the_problem(table, message):
    with pytest.raises(WorkloadError, match=re.escape(message)):
        family_from_dict(table)


def test_generation_errors():
    fam = family_from_dict({"kind": "prefix-tree", "trace": "missing.jsonl"})
    with pytest.raises(WorkloadError, match="missing.jsonl"):
        family_sessions(fam, duration_s=10.0, sources=("local",), seed=1)
    with pytest.raises(WorkloadError, match="duration_s"):
        family_sessions(fam, duration_s=0.0, sources=("local",), seed=1)
    with pytest.raises(WorkloadError, match="sources"):
        family_sessions(fam, duration_s=1.0, sources=(), seed=1)
