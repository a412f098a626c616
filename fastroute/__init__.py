"""fastroute: an LLM inference router.

A data plane (``fastroute serve``) picks an engine for every request by weighted
rendezvous hashing over a shared-memory weight table; a separate controller
computes those weights with a linear program. See ``docs/design.md``.
"""

from fastroute._version import __version__

__all__ = ["__version__"]
