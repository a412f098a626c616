"""Run-time switches read once from the environment."""

import os

__all__ = ["NO_EXTENSIONS"]

#: ``FASTROUTE_NO_EXTENSIONS=1`` runs the pure-Python twins of the compiled core
#: (aiohttp's ``AIOHTTP_NO_EXTENSIONS`` habit).
NO_EXTENSIONS: bool = os.environ.get("FASTROUTE_NO_EXTENSIONS", "") not in ("", "0")
