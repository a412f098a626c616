"""Read the plain subset of the Prometheus text exposition format, fast and exactly.

``prometheus_client``'s parser walks every line character by character: about 2.7 ms for an
emulated engine's 150-line ``/metrics``, and the controller parses every engine's once a second.
Engines (vLLM, the emulator) write *plain* text:

* printable ASCII, tabs and ``\\n`` line ends;
* ``# HELP name …`` and ``# TYPE name type`` comments without ``"`` (other comments are ignored),
  ``type`` one of ``counter``, ``gauge``, ``histogram``, ``summary``, ``untyped``;
* samples ``name value`` or ``name{label="value",…} value``, optionally `` timestamp`` (integer
  milliseconds), separated by single spaces, label values without ``\\`` or ``"``, label names
  neither reserved (``__…``) nor repeated;
* no ``counter`` ``# TYPE`` whose name lacks ``_total`` (the full parser renames such samples).

:func:`plain_samples` recognises that subset with regular expressions. On it, it returns what
``prometheus_client.parser.text_string_to_metric_families`` yields (the same sample names, label
values and values, in document order), restricted to the samples whose name has a given prefix;
for any other text it returns None and the caller must use the full parser, which accepts it or
raises as before. So a caller that falls back on None behaves exactly as if it always used the
full parser, only faster on plain text.
"""

from __future__ import annotations

import re

__all__ = ["plain_samples", "sample_value"]

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_PAIR_SRC = r'(?!__)[a-zA-Z_][a-zA-Z0-9_]*="[^"\\]*"'
_VALUE = r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[+-]?Inf|NaN"
# name, label body (None without braces), value; an optional integer timestamp is ignored
_SAMPLE = re.compile(
    rf"({_NAME})(?:\{{((?:{_PAIR_SRC}(?:,{_PAIR_SRC})*)?)\}})? ({_VALUE})(?: [+-]?[0-9]{{1,18}})?"
)
_METRIC_NAME = re.compile(_NAME)
#: ``# TYPE`` values of the plain subset (anything else: the full parser accepts or rejects it).
_PLAIN_TYPES = frozenset({"counter", "gauge", "histogram", "summary", "untyped"})
_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="([^"\\]*)"')


def plain_samples(text: str, prefix: str) -> list[tuple[str, dict[str, str], str]] | None:
    """The samples of ``text`` whose name starts with ``prefix``, or None if ``text`` is not plain.

    Parameters
    ----------
    text : str
        Prometheus text exposition (0.0.4).
    prefix : str
        Keep the samples whose name starts with it (``"vllm:"``); every line is still checked.

    Returns
    -------
    list of (str, dict of str to str, str) or None
        ``(name, labels, value text)`` in document order (read the value with
        :func:`sample_value`); None when the text is outside the plain subset (see module doc),
        valid or not: parse it with the full parser.
    """
    if not (text.isascii() and text.replace("\n", "").replace("\t", "").isprintable()):
        return None  # printable ASCII, tabs and \n only
    out: list[tuple[str, dict[str, str], str]] = []
    match = _SAMPLE.fullmatch
    for raw in text.split("\n"):
        line = raw.strip()
        if not line:
            continue
        if line[0] == "#":
            if '"' in line:
                return None
            parts = line.split(None, 3)
            if len(parts) < 2 or parts[1] not in ("HELP", "TYPE"):
                continue
            if parts[1] == "TYPE" and (
                len(parts) < 4
                or parts[3] not in _PLAIN_TYPES
                or (parts[3] == "counter" and not parts[2].endswith("_total"))
            ):
                return None  # an error, another type, or samples the full parser renames
            if len(parts) > 2 and _METRIC_NAME.fullmatch(parts[2]) is None:
                return None
            continue
        m = match(line)
        if m is None:
            return None
        name, body, value = m.groups()
        labels: dict[str, str] = {}
        if body:
            pairs = _PAIR.findall(body)
            labels = dict(pairs)
            if len(labels) != len(pairs):
                return None  # a repeated label name: the full parser rejects the line
        if name.startswith(prefix):
            out.append((name, labels, value))
    return out


def sample_value(text: str) -> float:
    """A sample's value as ``float(sample.value)`` of the full parser (an integer first).

    The full parser keeps integer texts as ``int``, so ``-0`` is ``0.0`` and an integer beyond
    the float range raises ``OverflowError`` once converted; this does the same. Only a text of
    ASCII digits with an optional sign can be such an integer (see :func:`plain_samples`' values).
    """
    if text.isdigit() or (text[1:].isdigit() and text[:1] in ("+", "-")):
        try:
            return float(int(text))
        except ValueError:  # more digits than int() converts
            pass
    return float(text)
