"""Property tests of the config loader (hypothesis): any TOML document, or any text at
all, is a ``Config`` or a ``ConfigError``, never another exception."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from fastroute.config import decode_config
from fastroute.errors import ConfigError

_SECTIONS = [
    "",
    "limits",
    "server",
    "routing",
    "controller",
    "engines",
    "classes",
    "tenants",
    "slo",
]
_KEYS = ["max_body_bytes", "port", "workers", "url", "name", "model", "policy", "weight", "x"]
_values = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True).map(lambda f: repr(f).replace("inf", "inf").replace("nan", "nan")),
    st.text(max_size=10).map(lambda s: '"' + s.replace("\\", "").replace('"', "") + '"'),
    st.sampled_from(["true", "false", "[]", "[1, 2]", '["a"]', "{}", "{ a = 1 }", "1979-05-27"]),
)


@st.composite
def toml_documents(draw: st.DrawFn) -> str:
    lines = []
    for _ in range(draw(st.integers(0, 6))):
        section = draw(st.sampled_from(_SECTIONS))
        if section:
            array = draw(st.booleans())
            lines.append(f"[[{section}]]" if array else f"[{section}]")
        for _ in range(draw(st.integers(0, 4))):
            lines.append(f"{draw(st.sampled_from(_KEYS))} = {draw(_values)}")
    return "\n".join(lines) + "\n"


def _config_or_error(text: str | bytes) -> None:
    try:
        decode_config(text, source="fuzz.toml")
    except ConfigError as exc:
        assert "fuzz.toml" in str(exc)


@given(toml_documents())
def test_any_toml_document_is_a_config_or_a_config_error(text: str) -> None:
    _config_or_error(text)


@given(st.text(max_size=200) | st.binary(max_size=200))
def test_any_text_is_a_config_or_a_config_error(text: str | bytes) -> None:
    _config_or_error(text)
