"""fastroute's hot path: the rendezvous selector and shared-memory atomics.

``Selector`` and ``AtomicBuffer`` are the compiled implementations unless
``FASTROUTE_NO_EXTENSIONS=1`` is set, in which case they are the pure-Python twins
(``selector_py``, ``shm_py``), which are also the specification. Both are always
importable under explicit names for parity tests: ``SelectorPy``/``SelectorC`` and
``AtomicBufferPy``/``AtomicBufferC`` (``None`` when the extension is not built).
"""

from __future__ import annotations

from fastroute._core.selector_py import Selector as SelectorPy
from fastroute._core.shm_py import AtomicBuffer as AtomicBufferPy
from fastroute._env import NO_EXTENSIONS

__all__ = [
    "NO_EXTENSIONS",
    "Selector",
    "SelectorC",
    "SelectorPy",
    "AtomicBuffer",
    "AtomicBufferC",
    "AtomicBufferPy",
]

try:
    from fastroute._core.selector import Selector as SelectorC
    from fastroute._core.shm import AtomicBuffer as AtomicBufferC
except ImportError as exc:  # extension not built
    if not NO_EXTENSIONS:
        raise ImportError(
            "fastroute's compiled core (fastroute._core.selector, fastroute._core.shm) is "
            "not built. Build it with `make build` (or `pip install .`), or set "
            "FASTROUTE_NO_EXTENSIONS=1 to run the slower pure-Python twins."
        ) from exc
    SelectorC = None  # type: ignore[assignment,misc]
    AtomicBufferC = None  # type: ignore[assignment,misc]

if NO_EXTENSIONS:
    Selector = SelectorPy
    AtomicBuffer = AtomicBufferPy
else:
    Selector = SelectorC  # type: ignore[assignment,misc]
    AtomicBuffer = AtomicBufferC  # type: ignore[assignment,misc]
