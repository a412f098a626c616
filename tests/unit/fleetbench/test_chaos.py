"""The chaos run's schedule, stream judging and summary (no processes; the run itself is
``tests/integration/fleetbench/test_chaos_run.py``)."""

from __future__ import annotations

import pytest

from fastroute.emulator.faults import FaultState
from fastroute.emulator.output_text import chat_output
from fastroute.fleetbench.chaos import markdown, summarize
from fastroute.fleetbench.chaos_faults import (
    DURATION_S,
    ENGINE_FAULTS,
    FAULT_KINDS,
    FaultEvent,
    engine_fault_body,
    schedule,
)
from fastroute.fleetbench.chaos_load import Outcome, _judge, _messages, _Stream, expected_text


def test_schedule_is_seeded_one_fault_at_a_time_and_covers_every_kind() -> None:
    events = schedule(7, 600.0, 4)
    assert events == schedule(7, 600.0, 4)
    assert events != schedule(8, 600.0, 4)
    assert {e.kind for e in events} == set(FAULT_KINDS)  # 600 s holds a whole round
    for before, after in zip(events, events[1:], strict=False):
        assert before.end_s <= after.start_s  # never two at once
    for e in events:
        assert e.end_s - e.start_s == DURATION_S[e.kind] and e.end_s <= 600.0
        assert 0 <= e.target < 4


def test_schedule_rejects_unknown_kinds_and_a_single_engine() -> None:
    with pytest.raises(ValueError, match="unknown fault kinds"):
        schedule(0, 100.0, 4, kinds=("meteor",))
    with pytest.raises(ValueError, match="at least 2 engines"):
        schedule(0, 100.0, 1)


def test_engine_fault_bodies_are_valid_emulator_faults() -> None:
    for kind in ENGINE_FAULTS:
        FaultState(**engine_fault_body(kind)).validate()


def test_expected_text_is_the_emulators_output_for_the_prompt() -> None:
    out = chat_output(_messages(3))
    assert expected_text(3, 5) == "".join(out.token(i) for i in range(5))
    assert expected_text(3, 5) != expected_text(4, 5)


@pytest.mark.parametrize(
    ("stream", "result", "reason"),
    [
        (_Stream(text=expected_text(1, 6), done=True, completion_tokens=6), "completed", ""),
        (_Stream(text=expected_text(1, 6), done=False, completion_tokens=6), "failed", "without"),
        (_Stream(text="", done=True, error="boom"), "failed", "stream error: boom"),
        (_Stream(text=expected_text(1, 6), done=True), "corrupt", "no usage"),
        # a repeated token at a migration seam
        (
            _Stream(
                text=expected_text(1, 3) + expected_text(1, 6)[len(expected_text(1, 2)) :],
                done=True,
                completion_tokens=6,
            ),
            "corrupt",
            "differs",
        ),  # fmt: skip
    ],
)
def test_judge(stream: _Stream, result: str, reason: str) -> None:
    got = _judge(stream, 1)
    assert got[0] == result and reason in got[1]


def _outcome(start_s: float, result: str, reason: str = "", migrated: bool = False) -> Outcome:
    return Outcome(0, start_s, start_s + 1.0, result, reason, 10, "rid", migrated)


def test_summary_attributes_outcomes_to_faults_and_excuses_only_worker_kills() -> None:
    events = [FaultEvent("engine_sigkill", 0, 10.0, 20.0), FaultEvent("worker_kill", 0, 30.0, 31.0)]
    outcomes = [
        _outcome(0.0, "completed"),
        _outcome(12.0, "completed", migrated=True),
        _outcome(30.5, "failed", "connection: ClientPayloadError"),
    ]
    s = summarize(outcomes, events)
    assert s["table"] == {
        "engine_sigkill": {"migrated": 1}, "none": {"completed": 1}, "worker_kill": {"failed": 1},
    }  # fmt: skip
    assert s["verdict"] == "pass" and s["unexcused_failures"] == 0
    s = summarize([*outcomes, _outcome(15.0, "failed", "HTTP 503: no engine")], events)
    assert s["verdict"] == "fail" and s["unexcused_failures"] == 1
    s = summarize([*outcomes, _outcome(50.0, "corrupt", "text differs")], events)
    assert s["verdict"] == "fail" and s["corrupt"] == 1
    assert "verdict **fail**" in markdown(s)


def test_a_refused_listener_reopens_when_the_fault_ends() -> None:
    # nothing can reach a closed listener to clear it: it must reopen by itself in time
    assert engine_fault_body("refuse")["refuse_for_s"] == DURATION_S["refuse"]
