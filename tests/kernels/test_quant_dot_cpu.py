"""The int8-activation products (`pagedserve_kernels/csrc/quant_dot_cpu.cpp`) against plain torch.

Oracles: `tests.kernels.quant_dot_reference` (the activation codes bit for bit; the integer
arithmetic of the product in float64 within float32 summation; the distance from the float32
product over the gguf package's dequantized weights within the activation rounding bound).
Every instruction set this CPU runs is forced by name, so an AVX-512 machine also runs the
AVX2 and non-VNNI paths; the sets this CPU offers are read from /proc/cpuinfo independently.
"""

from __future__ import annotations

import gguf
import pytest
import torch

from pagedserve_kernels import quant_dot_cpu
from pagedserve_kernels.q4_cpu import Q4Weight
from pagedserve_kernels.q8_cpu import Q8Weight
from pagedserve_kernels.quant_dot_cpu import PanelWeight, quant_matmul, quantize_activations
from tests.kernels.cpu_features import cpu_flags
from tests.kernels.gguf_blocks import gguf_blocks
from tests.kernels.quant_dot_reference import (
    activation_rounding_bound,
    reference_product,
    reference_quantize,
)

FLAGS = set(cpu_flags())
EXPECTED_ISAS = [
    name
    for name, needs in (
        ("avx512_vnni", {"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni"}),
        ("avx512bw", {"avx2", "fma", "avx512f", "avx512bw"}),
        ("avx_vnni", {"avx2", "fma", "avx_vnni"}),
        ("avx2", {"avx2", "fma"}),
    )
    if needs <= FLAGS
]
needs_kernel = pytest.mark.skipif(not EXPECTED_ISAS, reason="the kernel needs AVX2 and FMA")
Q4_1, Q8_0 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0


def test_the_kernel_runs_exactly_the_instruction_sets_this_cpu_has() -> None:
    assert list(quant_dot_cpu.supported_isas()) == EXPECTED_ISAS
    assert quant_dot_cpu.available() == bool(EXPECTED_ISAS)
    assert quant_dot_cpu.best_isa() == (EXPECTED_ISAS[0] if EXPECTED_ISAS else None)


def panels_of(kind: gguf.GGMLQuantizationType, rows: int, cols: int, seed: int) -> PanelWeight:
    _, weight = gguf_blocks(kind, rows, cols, seed)
    if kind == Q4_1:
        q4 = Q4Weight.recover(weight)
        assert q4 is not None
        return PanelWeight.from_q4(q4)
    q8 = Q8Weight.recover(weight)
    assert q8 is not None
    return PanelWeight.from_q8(q8)


@pytest.mark.parametrize("kind", [Q4_1, Q8_0], ids=["q4_1", "q8_0"])
@pytest.mark.parametrize(("rows", "cols"), [(1, 32), (17, 96), (40, 64), (100, 576)])
def test_panels_hold_the_gguf_weights_exactly(
    kind: gguf.GGMLQuantizationType, rows: int, cols: int
) -> None:
    _, weight = gguf_blocks(kind, rows, cols, seed=rows)
    panels = panels_of(kind, rows, cols, seed=rows)
    assert panels.shape == (rows, cols)
    assert torch.equal(panels.dequantize(), weight)
    codes, scales, mins = panels.unpacked()
    assert torch.equal(PanelWeight.pack(codes, scales, mins, panels.bits).codes, panels.codes)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_codes_equal_the_reference_bit_for_bit(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(37, 192, generator=generator) * torch.logspace(-6, 3, 37)[:, None]
    x[0] = 0.0  # d = 0: codes 0
    x[1, :32] = torch.arange(32) - 15.5  # exact halves: round half to even
    x[2, 40] = 1e30
    x = x.to(dtype)
    got = quantize_activations(x)
    codes, scales, sums = reference_quantize(x.float())
    assert torch.equal(got.codes, codes)
    assert torch.equal(got.scales, scales)
    assert torch.equal(got.sums, sums)
    assert int(got.codes.abs().max()) <= 127


@needs_kernel
@pytest.mark.parametrize("isa", EXPECTED_ISAS)
@pytest.mark.parametrize("kind", [Q4_1, Q8_0], ids=["q4_1", "q8_0"])
@pytest.mark.parametrize(
    ("rows", "out_features", "cols"),
    [(1, 576, 576), (3, 17, 32), (5, 40, 96), (17, 100, 64), (65, 33, 576), (130, 96, 1536)],
)
def test_product_equals_the_integer_reference_and_the_float32_product_within_bounds(
    isa: str, kind: gguf.GGMLQuantizationType, rows: int, out_features: int, cols: int
) -> None:
    """Rows not a multiple of the tile, columns not a multiple of a panel, K of whole blocks."""
    _, weight = gguf_blocks(kind, out_features, cols, seed=out_features)
    panels = panels_of(kind, out_features, cols, seed=out_features)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    got = quant_matmul(x, panels, isa)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    expected, summation = reference_product(x, *panels.unpacked())
    assert bool(((got.double() - expected).abs() <= summation).all())
    distance = (got.double() - (x.double() @ weight.double().T)).abs()
    assert bool((distance <= activation_rounding_bound(x, weight)).all())


@needs_kernel
@pytest.mark.parametrize("kind", [Q4_1, Q8_0], ids=["q4_1", "q8_0"])
def test_every_instruction_set_gives_the_same_bits(kind: gguf.GGMLQuantizationType) -> None:
    """Exact integer sums and the same float32 operations per block, in the same order."""
    panels = panels_of(kind, 72, 288, seed=5)
    x = torch.randn(23, 288, generator=torch.Generator().manual_seed(7))
    results = [quant_matmul(x, panels, isa) for isa in EXPECTED_ISAS]
    assert all(torch.equal(results[0], other) for other in results[1:])


@needs_kernel
@pytest.mark.parametrize("isa", EXPECTED_ISAS)
@pytest.mark.parametrize("rows", [1, 64, 100, 300])
def test_any_number_of_threads_gives_the_same_bits(isa: str, rows: int) -> None:
    """Threads split (row chunk, panel group) items and quantize their own chunks: an output is
    computed the same way whichever thread owns it, and chunks shared by two threads agree."""
    panels = panels_of(Q4_1, 200, 576, seed=11)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(quant_matmul(x, panels, isa))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(results[0], other) for other in results[1:])
    expected, summation = reference_product(x, *panels.unpacked())
    assert bool(((results[0].double() - expected).abs() <= summation).all())


@needs_kernel
@pytest.mark.parametrize("isa", EXPECTED_ISAS)
def test_bfloat16_inputs_give_the_float32_result_rounded_once(isa: str) -> None:
    panels = panels_of(Q4_1, 48, 128, seed=9)
    x = torch.randn(2, 6, 128, generator=torch.Generator().manual_seed(9)).bfloat16()
    got = quant_matmul(x, panels, isa)
    assert got.shape == (2, 6, 48) and got.dtype == torch.bfloat16
    assert torch.equal(got, quant_matmul(x.float(), panels, isa).bfloat16())


@needs_kernel
def test_bad_inputs_are_refused_with_a_clear_error() -> None:
    panels = panels_of(Q4_1, 16, 64, seed=1)
    with pytest.raises(ValueError, match="input width"):
        quant_matmul(torch.randn(2, 32), panels)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        quant_matmul(torch.randn(2, 64).half(), panels)
    with pytest.raises(ValueError, match="instruction set"):
        quant_matmul(torch.randn(2, 64), panels, "sse2")
    with pytest.raises(ValueError, match="4-, 5-, 6- or 8-bit"):
        PanelWeight.pack(
            torch.zeros(16, 64, dtype=torch.uint8), torch.zeros(16, 2), torch.zeros(16, 2), 7
        )
    with pytest.raises(ValueError, match="below 32"):
        PanelWeight.pack(
            torch.full((16, 64), 32, dtype=torch.uint8), torch.zeros(16, 2), torch.zeros(16, 2), 5
        )
    assert quant_matmul(torch.randn(0, 64), panels).shape == (0, 16)
