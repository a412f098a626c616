"""fastroute's hot path: the rendezvous selector, shared-memory atomics and the
``prefix-hrw`` decision.

``Selector``, ``AtomicBuffer``, ``PrefixPicker``, ``HotKeys`` and ``KeyLog`` are the
compiled implementations unless ``FASTROUTE_NO_EXTENSIONS=1`` is set, in which case they
are the pure-Python twins (``selector_py``, ``shm_py``, ``prefix_py``, ``keylog_py``),
which are also the specification. All are always importable under explicit names for
parity tests: ``SelectorPy``/``SelectorC``, ``AtomicBufferPy``/``AtomicBufferC``,
``PrefixPickerPy``/``PrefixPickerC``, ``HotKeysPy``/``HotKeysC`` and ``KeyLogPy``/``KeyLogC``
(``None`` when the extension is not built).
"""

from __future__ import annotations

from fastroute._core.keylog_py import KeyLog as KeyLogPy
from fastroute._core.prefix_py import HotKeys as HotKeysPy
from fastroute._core.prefix_py import PrefixPicker as PrefixPickerPy
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
    "HotKeys",
    "HotKeysC",
    "HotKeysPy",
    "KeyLog",
    "KeyLogC",
    "KeyLogPy",
    "PrefixPicker",
    "PrefixPickerC",
    "PrefixPickerPy",
]

try:
    from fastroute._core.prefix import HotKeys as HotKeysC
    from fastroute._core.prefix import KeyLog as KeyLogC
    from fastroute._core.prefix import PrefixPicker as PrefixPickerC
    from fastroute._core.selector import Selector as SelectorC
    from fastroute._core.shm import AtomicBuffer as AtomicBufferC
except ImportError as exc:  # extension not built
    if not NO_EXTENSIONS:
        raise ImportError(
            "fastroute's compiled core (fastroute._core.selector, .shm, .prefix) is "
            "not built. Build it with `make build` (or `pip install .`), or set "
            "FASTROUTE_NO_EXTENSIONS=1 to run the slower pure-Python twins."
        ) from exc
    SelectorC = None  # type: ignore[assignment,misc]
    HotKeysC = None  # type: ignore[assignment,misc]
    KeyLogC = None  # type: ignore[assignment,misc]
    PrefixPickerC = None  # type: ignore[assignment,misc]
    AtomicBufferC = None  # type: ignore[assignment,misc]

if NO_EXTENSIONS:
    Selector = SelectorPy
    AtomicBuffer = AtomicBufferPy
    HotKeys = HotKeysPy
    KeyLog = KeyLogPy
    PrefixPicker = PrefixPickerPy
else:
    Selector = SelectorC  # type: ignore[assignment,misc]
    AtomicBuffer = AtomicBufferC  # type: ignore[assignment,misc]
    HotKeys = HotKeysC  # type: ignore[assignment,misc]
    KeyLog = KeyLogC  # type: ignore[assignment,misc]
    PrefixPicker = PrefixPickerC  # type: ignore[assignment,misc]
