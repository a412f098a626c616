"""Property tests of the metrics parser (hypothesis): any ``/metrics`` text is signals
or a ``MetricsParseError``, never another exception, for every engine dialect."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from fastroute.signals.vllm import MetricsParseError, parse_engine_metrics

KINDS = ("vllm", "sglang")
_names = st.sampled_from(
    [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:gpu_cache_usage_perc",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:time_to_first_token_seconds_count",
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "x",
    ]
)
_labels = st.sampled_from(
    [
        "",
        '{model_name="m"}',
        '{le="0.1",model_name="m"}',
        '{le="+Inf"}',
        '{le="x"}',
        "{",
        '{a="\\"}',
    ]
)
_values = st.sampled_from(["1", "0.5", "-1", "NaN", "+Inf", "1e400", "x", "", "3 1700000000"])


@st.composite
def exposition_texts(draw: st.DrawFn) -> str:
    lines = []
    for _ in range(draw(st.integers(0, 12))):
        if draw(st.integers(0, 5)) == 0:
            lines.append(draw(st.sampled_from(["# HELP x y", "# TYPE x histogram", "#", ""])))
        lines.append(f"{draw(_names)}{draw(_labels)} {draw(_values)}")
    return "\n".join(lines) + draw(st.sampled_from(["\n", "", "\n# EOF\n"]))


def _signals_or_error(text: str) -> None:
    for kind in KINDS:
        try:
            parse_engine_metrics(text, kind)
        except MetricsParseError:
            pass


@given(exposition_texts())
def test_any_exposition_text_is_signals_or_a_parse_error(text: str) -> None:
    _signals_or_error(text)


@given(st.text(max_size=300))
def test_any_text_is_signals_or_a_parse_error(text: str) -> None:
    _signals_or_error(text)
