"""The simulator's routing keys (``dataplane.routing_key``): as the proxy derives them."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastroute.policy.prefix_hrw import PrefixHRW
from fastroute.sim import Simulator
from fastroute.sim.scenario import ScenarioError, scenario_from_dict

REPO = Path(__file__).resolve().parents[3]
#: Five prompts sent again and again (examples/traces/README.md).
TRACE = REPO / "examples" / "traces" / "repeated-prompts.jsonl"


def _keys(routing_key: str | None, monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """(key hash, key depth, prompt tokens) of every request prefix-hrw decides."""
    seen: list[tuple] = []
    choose = PrefixHRW.choose

    def record(self, request, view, k=3):
        seen.append((request.key_hash, request.key_depth_bytes, request.prompt_tokens))
        return choose(self, request, view, k)

    monkeypatch.setattr(PrefixHRW, "choose", record)
    dataplane = {} if routing_key is None else {"routing_key": routing_key}
    scenario = scenario_from_dict(
        {
            "name": "keys",
            "duration_s": 20.0,
            "drain_s": 30.0,
            "warmup_s": 0.0,
            "engines": [
                {"name": "a40", "count": 4, "profile": "a40-qwen2.5-3b", "model": "qwen2.5-3b"}
            ],
            "family": {"kind": "prefix-tree", "trace": str(TRACE), "rate_rps": 5.0},
            "control": {"optimiser": "static"},
            "dataplane": dataplane,
        }
    )
    Simulator(scenario, policy="prefix-hrw", seed=1).run()
    return seen


def test_sessions_have_their_own_keys_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = _keys(None, monkeypatch)
    assert len(keys) > 50 and len({k for k, _, _ in keys}) == len(keys)
    assert all(depth > 0 for _, depth, _ in keys)


def test_conversation_keys_are_shared_by_identical_prompts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The proxy's key of a chat without a session id is its text through the first user
    message: the five prompts are five keys, each at its prompt's depth."""
    keys = _keys("conversation", monkeypatch)
    assert len(keys) > 50 and len({k for k, _, _ in keys}) == 5
    by_key: dict[int, set] = {}
    for key, depth, tokens in keys:
        by_key.setdefault(key, set()).add((depth, tokens))
    assert all(len(shapes) == 1 for shapes in by_key.values())  # one prompt per key


def test_completion_keys_are_no_prefix_depth(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = _keys("completion", monkeypatch)
    assert len({k for k, _, _ in keys}) == 5 and {d for _, d, _ in keys} == {-1}


def test_an_unknown_routing_key_is_refused() -> None:
    with pytest.raises(ScenarioError, match="routing_key"):
        scenario_from_dict(
            {
                "name": "keys",
                "duration_s": 10.0,
                "engines": [
                    {"name": "a40", "count": 1, "profile": "a40-qwen2.5-3b", "model": "qwen2.5-3b"}
                ],
                "family": {"kind": "chat"},
                "dataplane": {"routing_key": "user"},
            }
        )
