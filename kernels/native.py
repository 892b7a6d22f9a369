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

POINTER, SIZE, FLAG = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
"""The argument types of the C ABI: a buffer, an int64 size or stride, an int flag."""


def load_library(
    module: str, supported: str, signatures: dict[str, list[type]]
) -> ctypes.CDLL | None:
    """The built extension `module` (e.g. "kernels._q4_cpu") with each function of
    `signatures` given its argument types and an int status result, or None where it was not
    built, cannot be loaded, or its `supported` function says this CPU cannot run it."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    try:
        library = ctypes.CDLL(spec.origin)
    except OSError:
        return None
    getattr(library, supported).restype = FLAG
    for name, argtypes in signatures.items():
        function = getattr(library, name)
        function.restype = FLAG
        function.argtypes = argtypes
    return library if getattr(library, supported)() else None
