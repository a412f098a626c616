"""Build the Cython extensions; all metadata lives in pyproject.toml.

Environment switches (read once here, mirrored at run time by ``fastroute._env``):

``FASTROUTE_NO_EXTENSIONS=1``
    Build nothing; the package then runs its pure-Python twins.
``FASTROUTE_CYTHON_DEBUG=1``
    Bounds checks, wraparound checks and line tracing on (for coverage and
    debugging); never use it for benchmarks.
"""

import os

from setuptools import Extension, setup

NO_EXTENSIONS = os.environ.get("FASTROUTE_NO_EXTENSIONS", "") not in ("", "0")
CYTHON_DEBUG = os.environ.get("FASTROUTE_CYTHON_DEBUG", "") not in ("", "0")

# The one place where compiler directives are set (sklearn's meson.build habit).
DIRECTIVES = {
    "language_level": 3,
    "boundscheck": CYTHON_DEBUG,
    "wraparound": CYTHON_DEBUG,
    "initializedcheck": CYTHON_DEBUG,
    "nonecheck": False,
    "cdivision": True,
    "embedsignature": True,
    "linetrace": CYTHON_DEBUG,
}

# -ffp-contract=off: no fused multiply-add, so every host computes bit-identical
# rendezvous scores (picks must agree across data planes). Never -ffast-math.
CFLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math"]
MACROS = [("CYTHON_TRACE_NOGIL", "1")] if CYTHON_DEBUG else []

EXTENSION_MODULES = ["fastroute._core.selector", "fastroute._core.shm", "fastroute._core.prefix"]


def _extensions() -> list:
    if NO_EXTENSIONS:
        print("*** fastroute: pure-Python build (FASTROUTE_NO_EXTENSIONS) ***")
        return []
    from Cython.Build import cythonize

    exts = [
        Extension(
            name,
            [name.replace(".", "/") + ".pyx"],
            extra_compile_args=CFLAGS,
            define_macros=MACROS,
        )
        for name in EXTENSION_MODULES
    ]
    return cythonize(
        exts,
        compiler_directives=DIRECTIVES,
        annotate=os.environ.get("FASTROUTE_CYTHON_ANNOTATE", "") not in ("", "0"),
    )


setup(ext_modules=_extensions())
