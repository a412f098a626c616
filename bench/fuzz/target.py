"""Run one fuzz target under atheris (libFuzzer): ``python bench/fuzz/target.py NAME
[libFuzzer flags] [corpus dirs]``; the names are those of ``targets.TARGETS``."""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports(include=["fastroute"]):
    from targets import TARGETS  # type: ignore[import-not-found]


def main() -> None:
    name = sys.argv.pop(1)
    atheris.Setup(sys.argv, TARGETS[name])
    atheris.Fuzz()


if __name__ == "__main__":
    main()
