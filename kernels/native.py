"""Loading the project's native CPU libraries (`kernels/csrc/*.cpp`, built by pip through
`setup.py`) with ctypes.

Each library has a plain C ABI: a `*_supported()` function that says whether this CPU runs it,
and functions that take pointers, sizes and flags and return a status. A library is loaded
after torch (every caller imports torch first), so its OpenMP calls share torch's libgomp (by
soname) and its thread team.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging

POINTER, SIZE, FLAG = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
"""The argument types of the C ABI: a buffer, an int64 size or stride, an int flag."""

log = logging.getLogger("pagedserve.native")


def load_library(
    module: str, supported: str, signatures: dict[str, list[type]]
) -> ctypes.CDLL | None:
    """The built extension `module` (e.g. "kernels._q4_cpu") with each function of
    `signatures` given its argument types and an int status result, or None where it was not
    built, cannot be loaded, or its `supported` function says this CPU cannot run it; each of
    those says so in the log (once per library: callers cache the answer), naming the torch
    path that runs instead."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        log.warning(
            "%s was not built (reinstall with a C++ compiler: `pip install -e .`): its torch "
            "path runs instead",
            module,
        )
        return None
    try:
        library = ctypes.CDLL(spec.origin)
    except OSError as error:
        log.warning("%s cannot be loaded (%s): its torch path runs instead", module, error)
        return None
    getattr(library, supported).restype = FLAG
    for name, argtypes in signatures.items():
        function = getattr(library, name)
        function.restype = FLAG
        function.argtypes = argtypes
    if not getattr(library, supported)():
        log.info("%s: this CPU lacks its instructions (%s): its torch path runs", module, supported)
        return None
    return library
