"""The plain-exposition reader: the same result as prometheus_client, or a fallback to it."""

from __future__ import annotations

import random

import pytest

from fastroute.emulator.faults import FaultController
from fastroute.emulator.metrics import EngineMetrics
from fastroute.emulator.model import EngineConfig, EngineModel
from fastroute.hardware import get_profile
from fastroute.signals import vllm
from fastroute.signals.exposition import plain_samples, sample_value
from fastroute.signals.vllm import parse_vllm_metrics


def _emulator_text(compat: str, model_name: str = "demo-8b") -> str:
    model = EngineModel(get_profile("a40"), EngineConfig(), seed=0)
    m = EngineMetrics(model_name, model, FaultController("e0"), compat=compat)
    for v in (0.05, 0.3, 0.3, 7.0):
        m.ttft.observe(v)
    m.itl.observe(0.02)
    m.e2e.observe(1.2)
    return m.render().decode()


def _outcome(text: str) -> str:
    """The exact result (repr keeps -0.0 and NaN apart) or the exception of a parse."""
    try:
        return repr(parse_vllm_metrics(text, scraped_at_s=1.0))
    except Exception as exc:  # noqa: BLE001 - comparing whatever the parse raises
        return f"{type(exc).__name__}: {exc}"


def _reference(text: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The outcome through prometheus_client only (the parser before the plain reader)."""
    with monkeypatch.context() as m:
        m.setattr(vllm, "plain_samples", lambda text, prefix: None)
        return _outcome(text)


@pytest.mark.parametrize("compat", ["current", "legacy", "both"])
def test_emulator_text_is_plain_and_never_reaches_the_full_parser(
    compat: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine's real /metrics is read without prometheus_client, with the same result."""
    text = _emulator_text(compat) + _emulator_text(compat, "other-model")
    expected = _reference(text, monkeypatch)
    assert plain_samples(text, "vllm:")

    def refuse(text: str) -> None:
        raise AssertionError("plain text went to the full parser")

    monkeypatch.setattr(vllm, "text_string_to_metric_families", refuse)
    assert _outcome(text) == expected
    assert "demo-8b" in expected and "other-model" in expected


@pytest.mark.parametrize(
    ("text", "plain"),
    [
        ('vllm:num_requests_running{model_name="m"} -0\n', True),
        ('vllm:num_requests_running{model_name="m"} 1e3 1700000000000\n', True),
        ('vllm:num_requests_running{model_name="m",} 1\n', False),
        ('vllm:num_requests_running{model_name="a}b{c"} 1\n', True),
        ('vllm:num_requests_running{model_name="a\\"b"} 1\n', False),
        ('vllm:num_requests_running{model_name="m",model_name="n"} 1\n', False),
        ('vllm:num_requests_running{__name__="x"} 1\n', False),
        ('vllm:num_requests_running{model_name="m"}\t1\n', False),
        ('vllm:num_requests_running{model_name="m"} nan\n', False),
        ('vllm:num_requests_running{model_name="m"} 1' + "0" * 400 + "\n", True),
        ('vllm:num_requests_running{model_name="m"} 1' + "0" * 5000 + "\n", True),
        ("vllm:num_requests_running 1 2 3\n", False),
        ("# TYPE vllm:num_preemptions counter\nvllm:num_preemptions 4\n", False),
        ("# TYPE vllm:num_preemptions_total counter\nvllm:num_preemptions_total 4\n", True),
        ("# TYPE vllm:num_requests_running\nvllm:num_requests_running 4\n", False),
        ("# HELP vllm:num_requests_running caf\u00e9\nvllm:num_requests_running 4\n", False),
        ("# HELP 1bad x\nvllm:num_requests_running 4\n", False),
        ('# HELP "quoted" x\nvllm:num_requests_running 4\n', False),
        ("vllm:num_requests_running 4\r\n", False),
        ('vllm:time_to_first_token_seconds_bucket{model_name="m",le="x"} 1\n', True),
        ('vllm:time_to_first_token_seconds_bucket{model_name="m"} 1\n', True),
        ("vllm:num_requests_running{} 2\n# EOF\n\n", True),
    ],
)
def test_edge_cases_match_the_full_parser(
    text: str, plain: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each case is plain or falls back, and the outcome (result or error) is the reference's."""
    assert (plain_samples(text, "vllm:") is not None) == plain
    assert _outcome(text) == _reference(text, monkeypatch)


def test_random_corruptions_give_the_reference_outcome(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded random edits of a real text: same result or same error as prometheus_client."""
    base = _emulator_text("both").split("\n")
    alphabet = list('"{}=, \t\\#_:.eE+-019aZI_\r') + ["\u00e9", "\n", "Inf", "NaN", "__"]
    rng = random.Random(7)
    plain_seen = 0
    for _ in range(150):
        lines = list(base)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(lines))
            line = lines[i]
            op = rng.randrange(4)
            j = rng.randint(0, len(line))
            if op == 0:
                lines[i] = line[:j] + rng.choice(alphabet) + line[j:]
            elif op == 1 and line:
                lines[i] = line[:j] + line[j + 1 :]
            elif op == 2:
                lines.insert(rng.randrange(len(lines)), line)
            else:
                lines[i] = line.replace(" ", rng.choice(["  ", "\t", " # "]), 1)
        text = "\n".join(lines)
        plain_seen += plain_samples(text, "vllm:") is not None
        assert _outcome(text) == _reference(text, monkeypatch), text
    assert plain_seen > 0  # some corruptions stay plain (compared as read by the plain reader)


def test_sample_value_converts_like_the_full_parser() -> None:
    """Integers first (so -0 is +0.0), then floats; an integer beyond floats overflows."""
    assert repr(sample_value("-0")) == "0.0"
    assert sample_value("2.5e1") == 25.0 and sample_value("+Inf") == float("inf")
    with pytest.raises(OverflowError):
        sample_value("1" + "0" * 400)
