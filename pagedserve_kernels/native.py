"""Loading the project's native CPU libraries (`pagedserve_kernels/csrc/*.cpp`, built by pip through
`setup.py`) with ctypes.

Each library has a plain C ABI: a `*_supported()` function that says whether this CPU runs it,
and functions that take pointers, sizes and flags and return a status. The vector kernels (q4,
q8, attention, layer ops, decoder stack) are compiled once per instruction set of
`VECTOR_ISAS`; their functions take the set to run as their first argument, and
`*_isa_supported(isa)` says which this CPU has, so tests can run each (`library_isas`,
`NativeLibrary.isa_number`). A library is loaded
after torch (every caller imports torch first), so its OpenMP calls share torch's libgomp (by
soname) and its thread team.

`NativeLibrary` is one library as this process loaded it: the handle (or None), and the
instruction sets this CPU runs it with. Each wrapper module builds its own once, on first use
(a `functools.cache`d function), and answers `available()`, `supported_isas()` and
`best_isa()` from it.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
from collections.abc import Mapping
from dataclasses import dataclass

POINTER, SIZE, FLAG = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
"""The argument types of the C ABI: a buffer, an int64 size or stride, an int flag."""

VECTOR_ISAS: dict[str, int] = {"avx512": 2, "avx2": 1}
"""The instruction sets the vector kernels are compiled for, fastest first, with the C ABI's
numbers (`cpu_common::Isa`): "avx512" is AVX-512 F and BW, "avx2" AVX2 with FMA."""

log = logging.getLogger("pagedserve.native")


def load_library(
    module: str, supported: str, signatures: dict[str, list[type]]
) -> ctypes.CDLL | None:
    """The built extension `module` (e.g. "pagedserve_kernels._q4_cpu") with each function of
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


def library_isas(
    library: ctypes.CDLL | None, isa_supported: str, isa_numbers: Mapping[str, int] = VECTOR_ISAS
) -> tuple[str, ...]:
    """The names of `isa_numbers` that `library`'s function `isa_supported` says this CPU runs,
    fastest first (none where the library is None)."""
    if library is None:
        return ()
    check = getattr(library, isa_supported)
    check.restype = FLAG
    check.argtypes = [FLAG]
    return tuple(name for name, number in isa_numbers.items() if check(number))


@dataclass(frozen=True)
class NativeLibrary:
    """A native library as loaded in this process. Invariants: `isas` is empty where `handle`
    is None, else the names of `isa_numbers` the library says this CPU runs, fastest first."""

    module: str
    handle: ctypes.CDLL | None
    isas: tuple[str, ...]
    isa_numbers: Mapping[str, int]

    @classmethod
    def load(
        cls,
        module: str,
        supported: str,
        signatures: dict[str, list[type]],
        isa_supported: str,
        isa_numbers: Mapping[str, int] = VECTOR_ISAS,
    ) -> NativeLibrary:
        """`load_library(module, supported, signatures)`, and which of `isa_numbers` its
        function `isa_supported` says this CPU runs. Build it once per library (each load
        logs why a library is missing)."""
        handle = load_library(module, supported, signatures)
        return cls(module, handle, library_isas(handle, isa_supported, isa_numbers), isa_numbers)

    def available(self) -> bool:
        """Whether the library was built and this CPU runs it."""
        return self.handle is not None

    def best_isa(self) -> str | None:
        """The fastest instruction set this CPU runs the library with (None: none)."""
        return next(iter(self.isas), None)

    def isa_number(self, isa: str | None) -> int:
        """The C ABI number of `isa` (None: the fastest this CPU runs); ValueError where this
        CPU does not run the library with it."""
        chosen = isa if isa is not None else self.best_isa()
        if chosen is None or chosen not in self.isas:
            raise ValueError(f"instruction set {chosen!r} is not one of {self.isas}")
        return self.isa_numbers[chosen]

    def require(self, unavailable: str) -> ctypes.CDLL:
        """The handle; RuntimeError(`unavailable`) where the library is not available."""
        if self.handle is None:
            raise RuntimeError(unavailable)
        return self.handle
