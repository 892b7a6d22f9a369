"""Loading the project's native CPU libraries (`kernels/csrc/*.cpp`, built by pip through
`setup.py`) with ctypes.

Each library has a plain C ABI: a `*_supported()` function that says whether this CPU runs it,
and functions that take pointers, sizes and flags and return a status. The vector kernels (q4,
q8, attention, layer ops, decoder stack) are compiled once per instruction set of
`VECTOR_ISAS`; their functions take the set to run as their first argument, and
`*_isa_supported(isa)` says which this CPU has, so tests can run each (`library_isas`,
`isa_number`). A library is loaded
after torch (every caller imports torch first), so its OpenMP calls share torch's libgomp (by
soname) and its thread team.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging

POINTER, SIZE, FLAG = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
"""The argument types of the C ABI: a buffer, an int64 size or stride, an int flag."""

VECTOR_ISAS: dict[str, int] = {"avx512": 2, "avx2": 1}
"""The instruction sets the vector kernels are compiled for, fastest first, with the C ABI's
numbers (`cpu_common::Isa`): "avx512" is AVX-512 F and BW, "avx2" AVX2 with FMA."""

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


def library_isas(library: ctypes.CDLL | None, isa_supported: str) -> tuple[str, ...]:
    """The names of `VECTOR_ISAS` that `library`'s function `isa_supported` says this CPU runs,
    fastest first (none where the library is None)."""
    if library is None:
        return ()
    check = getattr(library, isa_supported)
    check.restype = FLAG
    check.argtypes = [FLAG]
    return tuple(name for name, number in VECTOR_ISAS.items() if check(number))


def isa_number(isa: str | None, supported: tuple[str, ...]) -> int:
    """The C ABI number of instruction set `isa` (None: the fastest of `supported`).

    Raises ValueError where `isa` is not one of `supported`."""
    chosen = isa if isa is not None else next(iter(supported), None)
    if chosen is None or chosen not in supported:
        raise ValueError(f"instruction set {chosen!r} is not one of {supported}")
    return VECTOR_ISAS[chosen]
