"""The fastroute exception hierarchy.

Every error fastroute raises on purpose derives from :class:`FastrouteError`, and
its message says what was expected and what was found.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "FastrouteError",
    "ConfigError",
    "NoEngineAvailable",
    "TableError",
    "TableFencedError",
    "TableNotFoundError",
    "TableEmptyError",
    "TableFormatError",
    "TableVersionError",
    "TableSizeError",
    "TableDimensionError",
    "TableLockedError",
    "TableValueError",
]


class FastrouteError(Exception):
    """Root of every error fastroute raises on purpose."""


class NoEngineAvailable(FastrouteError):
    """No engine of the request's class row has weight > 0 and is available."""


class TableError(FastrouteError):
    """A shared-memory segment (weight table or stats block) cannot be used."""


class TableNotFoundError(TableError, FileNotFoundError):
    """The named segment does not exist (no writer has created it yet)."""


class TableEmptyError(TableError):
    """The segment exists but nothing has been published to it yet."""


class TableFormatError(TableError):
    """The segment's magic number is not the expected one: it is not a fastroute segment."""


class TableVersionError(TableError):
    """The segment was written with a different layout version."""


class TableSizeError(TableError):
    """The segment is smaller than its header says it must be (truncated or corrupt)."""


class TableDimensionError(TableError, ValueError):
    """Engine or class counts exceed the segment's maxima, or arrays disagree in shape."""


class TableLockedError(TableError):
    """Another live writer owns the segment."""


class TableValueError(TableError, ValueError):
    """A value to publish is invalid (NaN, negative or infinite weight, fraction outside [0, 1])."""


class TableFencedError(TableError):
    """A table of an older controller epoch than the one in force (a deposed leader's)."""


class ConfigError(FastrouteError, ValueError):
    """The configuration cannot be used; the message names the file and the bad field.

    Parameters
    ----------
    source : str
        The file name, or ``"<string>"`` for text given directly.
    problems : sequence of (str or None, str)
        ``(json_path, message)`` pairs; ``json_path`` is ``None`` when the problem has
        no path (a TOML syntax error).
    lineno : int, optional
        The TOML line of a syntax error.

    Attributes
    ----------
    source : str
        As given.
    problems : tuple of (str or None, str)
        Every problem found, in document order (msgspec stops at the first type error;
        cross-field checks report all of theirs).
    path : str or None
        The JSON path of the first problem, e.g. ``"$.engines[1].url"``.
    lineno : int or None
        The TOML line of a syntax error, else ``None``.
    """

    def __init__(
        self,
        source: str,
        problems: Sequence[tuple[str | None, str]],
        *,
        lineno: int | None = None,
    ) -> None:
        if not problems:
            raise ValueError("ConfigError needs at least one problem")
        self.source = source
        self.problems = tuple(problems)
        self.path = self.problems[0][0]
        self.lineno = lineno
        lines = [msg if path is None else f"{msg} - at `{path}`" for path, msg in self.problems]
        if len(lines) == 1:
            text = f"{source}: {lines[0]}"
        else:
            text = f"{source}: {len(lines)} problems:\n" + "\n".join(f"  {ln}" for ln in lines)
        super().__init__(text)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_config_error, (self.source, self.problems, self.lineno))


def _rebuild_config_error(
    source: str, problems: Sequence[tuple[str | None, str]], lineno: int | None
) -> ConfigError:
    return ConfigError(source, problems, lineno=lineno)
