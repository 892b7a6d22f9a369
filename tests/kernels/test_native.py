"""`pagedserve_kernels.native.NativeLibrary`: availability, the instruction sets this CPU runs a
library with and their C ABI numbers, against /proc/cpuinfo (`tests.kernels.cpu_features`) and
`VECTOR_ISAS` as written."""

from __future__ import annotations

import pytest

from pagedserve_kernels import q4_cpu
from pagedserve_kernels.native import VECTOR_ISAS, NativeLibrary
from tests.kernels.cpu_features import cpu_vector_isas, needs_vector_kernels


def test_a_library_that_did_not_load_offers_nothing() -> None:
    missing = NativeLibrary("pagedserve_kernels._absent", None, (), VECTOR_ISAS)
    assert not missing.available()
    assert missing.best_isa() is None
    with pytest.raises(ValueError, match="not one of"):
        missing.isa_number(None)
    with pytest.raises(RuntimeError, match="not here"):
        missing.require("not here")


def test_a_module_that_was_not_built_loads_as_unavailable() -> None:
    absent = NativeLibrary.load(
        "pagedserve_kernels._no_such_library", "x_supported", {}, "x_isa_supported"
    )
    assert (absent.handle, absent.isas, absent.available()) == (None, (), False)


@needs_vector_kernels
def test_a_loaded_library_numbers_the_sets_this_cpu_has() -> None:
    loaded = NativeLibrary.load(
        "pagedserve_kernels._q4_cpu", "q4_supported", {}, "q4_isa_supported"
    )
    assert loaded.available() and loaded.require("unused") is loaded.handle
    assert loaded.isas == cpu_vector_isas() == q4_cpu.supported_isas()
    assert loaded.best_isa() == cpu_vector_isas()[0] == q4_cpu.best_isa()
    assert loaded.isa_number(None) == VECTOR_ISAS[cpu_vector_isas()[0]]
    for isa in cpu_vector_isas():
        assert loaded.isa_number(isa) == VECTOR_ISAS[isa]
    for lacking in [*(set(VECTOR_ISAS) - set(cpu_vector_isas())), "sse2"]:
        with pytest.raises(ValueError, match="not one of"):
            loaded.isa_number(lacking)
