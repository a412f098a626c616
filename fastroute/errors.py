"""The fastroute exception hierarchy.

Every error fastroute raises on purpose derives from :class:`FastrouteError`, and
its message says what was expected and what was found.
"""

from __future__ import annotations

__all__ = [
    "FastrouteError",
    "NoEngineAvailable",
    "TableError",
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
