"""A ``[replay]`` spec's sessions: the simulator's mix, at the spec's rate, trace-exact sizes."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from bench_specs import write_pd_spec

from fastroute.fleetbench.replay import replay_rate_rps, replay_sessions
from fastroute.fleetbench.runner import build_sessions, target_rps
from fastroute.fleetbench.spec import load_spec
from fastroute.tokens import count_text_tokens, render_chat
from fastroute.workload.mix import mixed_replay_sessions
from fastroute.workload.session import CHAT_OVERHEAD_TOKENS


def test_the_sessions_are_the_simulators_at_load_times_capacity(tmp_path: Path) -> None:
    spec = load_spec(write_pd_spec(tmp_path))
    assert spec.replay is not None
    # load 0.5 × min(1 × 3.0 prefill, 2 × 4.0 decode) req/s
    assert replay_rate_rps(spec) == pytest.approx(1.5) == target_rps(spec)
    sessions = replay_sessions(spec)
    expected = mixed_replay_sessions(
        msgspec.structs.replace(spec.replay, rate_rps=1.5),
        duration_s=25.0, sources=("local",), seed=4,
        base_dir=str(tmp_path),
    )  # fmt: skip
    assert sessions == expected and len(sessions) > 10
    assert {s.tenant for s in sessions} == {"conv", "code"}
    assert all(0.0 <= s.start_s < 25.0 for s in sessions)
    built, sources, description = build_sessions(spec)
    assert built == sessions and sources == ["local"]
    mix = "(conv 0.75, code 0.25; bursts 2×"
    assert description.startswith(f"replay: {len(sessions)} requests {mix}")


def test_without_load_the_replay_keeps_its_rate(tmp_path: Path) -> None:
    spec = load_spec(write_pd_spec(tmp_path, load=""))
    assert spec.load is None and replay_rate_rps(spec) == 2.5
    other = load_spec(write_pd_spec(tmp_path, load="", **{"seed = 4": "seed = 5"}))
    assert [s.session_id for s in replay_sessions(spec)] != [
        s.session_id for s in replay_sessions(other)
    ]


def test_prompts_and_outputs_have_the_traces_sizes(tmp_path: Path) -> None:
    """The emulator counts the rendered chat prompt as the trace's prompt tokens (prompts
    shorter than the chat template get the template's length), and ``max_tokens`` is
    the trace's output (the driver sends ``ignore_eos``)."""
    spec = load_spec(write_pd_spec(tmp_path))
    trace = (tmp_path / "traces" / "t.csv").read_text().splitlines()[1:]
    rows = [tuple(int(x) for x in line.split(",")[1:]) for line in trace]
    short = 0
    for s in replay_sessions(spec):
        index = int(s.session_id.rsplit("-", 1)[1])
        prompt, output = rows[index]
        assert s.prompt_tokens_hint == (prompt,)
        (turn,) = s.turns
        assert turn.max_tokens == output
        rendered = count_text_tokens(render_chat(s.messages(0, [])))
        if prompt > CHAT_OVERHEAD_TOKENS:
            assert rendered == prompt, s.session_id
        else:
            short += 1
            assert rendered == CHAT_OVERHEAD_TOKENS + 1
    assert short < 5
