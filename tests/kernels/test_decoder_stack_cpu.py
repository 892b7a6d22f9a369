"""The native decoder stack (`pagedserve_kernels.decoder_stack_cpu`) against two oracles on random
quantized layers (exact 4-bit copies, int8-activation panels of 4, 5 and 8 bits, and a mix): a
plain-torch float64 forward that rounds where the model rounds (the hidden states and the KV it
writes; the int8 products through `tests.kernels.quant_dot_reference`), and the same native
kernels called one by one from Python (bit for bit). Also: rows and thread counts do not change a
row's bits, and bad operands are refused."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from pagedserve_kernels import (
    attention_cpu,
    decoder_stack_cpu,
    layer_ops_cpu,
    q4_cpu,
    quant_dot_cpu,
    reference,
)
from pagedserve_kernels.attention_cpu import DecodeRows
from pagedserve_kernels.decoder_stack_cpu import DecoderStack, StackLayer, StackShape, StackWeight
from pagedserve_kernels.metadata import prepare_attention
from pagedserve_kernels.q4_cpu import Q4Weight
from pagedserve_kernels.quant_dot_cpu import PanelWeight
from tests.kernels.cpu_features import (
    cpu_has_avx2_fma,
    cpu_vector_isas,
    each_isa,
    needs_vector_kernels,
)
from tests.kernels.quant_dot_reference import reference_product

needs_kernel = needs_vector_kernels

SHAPE = StackShape(
    hidden=64, num_q=4, num_kv=2, head_dim=32, intermediate=96, eps=1e-5, scale=32**-0.5
)
BLOCK_SIZE, NUM_BLOCKS = 4, 32


def test_library_is_built_wherever_the_cpu_runs_it() -> None:
    assert decoder_stack_cpu.available() == cpu_has_avx2_fma()
    assert decoder_stack_cpu.supported_isas() == cpu_vector_isas()


def _q4(rows: int, cols: int, generator: torch.Generator) -> Q4Weight:
    """Random Q4_1 blocks centred on zero: float16 scales, codes 0..15."""
    codes = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=generator)
    scales = (torch.rand(rows, cols // 32, generator=generator) * 0.04 + 0.01).half().float()
    mins = -7.5 * scales + 0.01 * torch.randn(rows, cols // 32, generator=generator)
    return Q4Weight(codes, scales.contiguous(), mins.contiguous())


def _panels(rows: int, cols: int, bits: int, generator: torch.Generator) -> PanelWeight:
    """Random `bits`-bit codes in the int8 kernel's panels, weights of the same size as `_q4`'s."""
    if bits == 4:
        return PanelWeight.from_q4(_q4(rows, cols, generator))
    top = (1 << bits) - 1
    codes = torch.randint(0, top + 1, (rows, cols), dtype=torch.uint8, generator=generator)
    scales = (torch.rand(rows, cols // 32, generator=generator) * 0.04 + 0.01) * 15 / top
    mins = -0.5 * top * scales + 0.01 * torch.randn(rows, cols // 32, generator=generator)
    return PanelWeight.pack(codes, scales.contiguous(), mins.contiguous(), bits)


PRODUCTS = ("q4", "panels", "mixed")
"""Which copy each layer's four products (qkv, out, gate_up, down) are: all exact 4-bit, all
int8 panels (4, 8, 5 and 4 bits), or exact and panels alternating."""


def _weights(
    products: str, shapes: list[tuple[int, int]], generator: torch.Generator
) -> list[StackWeight]:
    if products == "q4":
        return [_q4(rows, cols, generator) for rows, cols in shapes]
    if products == "panels":
        return [_panels(rows, cols, bits, generator) for (rows, cols), bits in
                zip(shapes, (4, 8, 5, 4), strict=True)]  # fmt: skip
    assert products == "mixed"
    return [
        _q4(rows, cols, generator) if index % 2 == 0 else _panels(rows, cols, 8, generator)
        for index, (rows, cols) in enumerate(shapes)
    ]


def _norm(generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return (1 + 0.2 * torch.randn(SHAPE.hidden, generator=generator)).to(dtype)


@dataclass
class StackCase:
    """One decode step of `rows` sequences over random layers and a pre-filled KV pool."""

    stack: DecoderStack
    residual: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor
    kv_pool: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    decodes: DecodeRows

    def select(self, rows: list[int]) -> StackCase:
        """The same step with only the given sequences (fresh copies of everything mutable)."""
        index = torch.tensor(rows)
        context_lens = self.context_lens[index]
        block_tables = self.block_tables[index]
        slots = self.slots[index]
        return dataclasses.replace(
            self,
            residual=self.residual[index].clone(),
            cos=self.cos[index],
            sin=self.sin[index],
            slots=slots,
            kv_pool=self.kv_pool.clone(),
            context_lens=context_lens,
            block_tables=block_tables,
            decodes=_decodes(context_lens, block_tables, slots),
        )


def _decodes(context_lens: torch.Tensor, tables: torch.Tensor, slots: torch.Tensor) -> DecodeRows:
    rows = context_lens.shape[0]
    prepared = prepare_attention(
        torch.arange(rows + 1, dtype=torch.int32),
        context_lens,
        tables,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        slot_mapping=slots,
        device=torch.device("cpu"),
    )
    assert prepared.decode_rows is not None
    return prepared.decode_rows


def make_case(
    dtype: torch.dtype,
    context_lens: tuple[int, ...] = (5, 9, 1, 14),
    windows: tuple[int | None, ...] = (None, 3, None),
    seed: int = 0,
    isa: str | None = None,
    products: str = "q4",
    quant_isa: str | None = None,
) -> StackCase:
    generator = torch.Generator().manual_seed(seed)
    q_width = SHAPE.num_q * SHAPE.head_dim
    qkv_rows = (SHAPE.num_q + 2 * SHAPE.num_kv) * SHAPE.head_dim
    shapes = [
        (qkv_rows, SHAPE.hidden),
        (SHAPE.hidden, q_width),
        (2 * SHAPE.intermediate, SHAPE.hidden),
        (SHAPE.hidden, SHAPE.intermediate),
    ]
    layers = []
    for window in windows:
        input_norm, post_norm = _norm(generator, dtype), _norm(generator, dtype)
        qkv, out, gate_up, down = _weights(products, shapes, generator)
        layers.append(StackLayer(input_norm, qkv, out, post_norm, gate_up, down, window))
    stack = DecoderStack(layers, SHAPE, _norm(generator, torch.float32), dtype, isa, quant_isa)
    rows = len(context_lens)
    ids = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    width = max(-(-length // BLOCK_SIZE) for length in context_lens)
    tables = torch.zeros(rows, width, dtype=torch.int32)
    for row, length in enumerate(context_lens):
        for j in range(-(-length // BLOCK_SIZE)):
            tables[row, j] = ids.pop()
    lens = torch.tensor(context_lens, dtype=torch.int32)
    positions = lens.long() - 1
    slots = tables[torch.arange(rows), positions // BLOCK_SIZE].long() * BLOCK_SIZE
    slots += positions % BLOCK_SIZE
    angles = positions[:, None].float() * torch.rand(SHAPE.head_dim // 2, generator=generator)
    angles = torch.cat((angles, angles), dim=-1)
    pool_shape = (len(windows), 2, NUM_BLOCKS, BLOCK_SIZE, SHAPE.num_kv, SHAPE.head_dim)
    return StackCase(
        stack=stack,
        residual=torch.randn(rows, SHAPE.hidden, generator=generator),
        cos=angles.cos(),
        sin=angles.sin(),
        slots=slots,
        kv_pool=torch.randn(pool_shape, generator=generator).to(dtype),
        context_lens=lens,
        block_tables=tables,
        decodes=_decodes(lens, tables, slots),
    )


def run_stack(case: StackCase) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, KV pool) of the native stack, on copies."""
    pool, residual = case.kv_pool.clone(), case.residual.clone()
    out = case.stack.run(residual, case.cos, case.sin, case.slots, pool, case.decodes)
    return out, pool


def per_operator(case: StackCase) -> tuple[torch.Tensor, torch.Tensor]:
    """The same step through the native kernels one call at a time (the model's per-operator
    path with each product on the kernel of its copy), with the stack's instruction sets."""
    stack, dtype, isa = case.stack, case.stack.dtype, case.stack.isa

    def product(x: torch.Tensor, weight: StackWeight) -> torch.Tensor:
        if isinstance(weight, PanelWeight):
            return quant_dot_cpu.quant_matmul(x, weight, isa=stack.quant_isa)
        return q4_cpu.q4_matmul(x, weight, isa=isa)

    pool, residual = case.kv_pool.clone(), case.residual.clone()
    rows, heads = residual.shape[0], (SHAPE.num_q, SHAPE.num_kv, SHAPE.head_dim)
    pending = None
    for index, layer in enumerate(stack.layers):
        k_cache, v_cache = pool[index, 0], pool[index, 1]
        normed = layer_ops_cpu.add_rms_norm(
            residual, pending, layer.input_norm, SHAPE.eps, dtype, isa=isa
        )
        qkv = product(normed, layer.qkv)
        q = layer_ops_cpu.rotary_write_kv(qkv, heads, case.cos, case.sin, case.slots,
                                          k_cache, v_cache, isa=isa)  # fmt: skip
        attended = torch.empty_like(q)
        attention_cpu.decode_attention(
            q, k_cache, v_cache, case.decodes, SHAPE.scale, layer.window, attended, isa=isa
        )
        projected = product(attended.reshape(rows, -1), layer.out)
        normed = layer_ops_cpu.add_rms_norm(
            residual, projected, layer.post_norm, SHAPE.eps, dtype, isa=isa
        )
        activated = layer_ops_cpu.silu_mul(product(normed, layer.gate_up), isa=isa)
        pending = product(activated, layer.down)
    out = layer_ops_cpu.add_rms_norm(
        residual, pending, stack.final_norm, SHAPE.eps, torch.float32, isa=isa
    )
    return out, pool


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight.double() * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + SHAPE.eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None].double() + rotated * sin[:, None].double()


def oracle(case: StackCase) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch in float64, rounding to the activations' dtype where the model does."""
    stack, dtype = case.stack, case.stack.dtype
    pool, residual = case.kv_pool.clone(), case.residual.double()
    rows, d, nq, nkv = residual.shape[0], SHAPE.head_dim, SHAPE.num_q, SHAPE.num_kv

    def linear(x: torch.Tensor, weight: StackWeight) -> torch.Tensor:
        if isinstance(weight, PanelWeight):  # the int8 kernel's arithmetic, in float64
            return reference_product(x.float(), *weight.unpacked())[0].to(dtype)
        return (x.double() @ weight.dequantize().double().T).to(dtype)

    pending = None
    for index, layer in enumerate(stack.layers):
        if pending is not None:
            residual = residual + pending.double()
        qkv = linear(_rms(residual, layer.input_norm).to(dtype), layer.qkv).double()
        q, k, v = qkv.view(rows, nq + 2 * nkv, d).split([nq, nkv, nkv], dim=1)
        q = _rotate(q, case.cos, case.sin).to(dtype)
        k_flat, v_flat = pool[index, 0].view(-1, nkv, d), pool[index, 1].view(-1, nkv, d)
        k_flat[case.slots] = _rotate(k, case.cos, case.sin).to(dtype)
        v_flat[case.slots] = v.to(dtype)
        attended = reference.paged_attention(
            q,
            pool[index, 0],
            pool[index, 1],
            cu_query_lens=torch.arange(rows + 1, dtype=torch.int32),
            context_lens=case.context_lens,
            block_tables=case.block_tables,
            scale=SHAPE.scale,
            sliding_window=layer.window,
        )
        residual = residual + linear(attended.reshape(rows, -1), layer.out).double()
        gate_up = linear(_rms(residual, layer.post_norm).to(dtype), layer.gate_up).double()
        gate, up = gate_up.chunk(2, dim=-1)
        pending = linear((F.silu(gate) * up).to(dtype), layer.down)
    assert pending is not None
    residual = residual + pending.double()
    return _rms(residual, stack.final_norm).float(), pool


@needs_kernel
@each_isa
@pytest.mark.parametrize("products", PRODUCTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_kernels_called_one_by_one_bit_for_bit(
    isa: str, dtype: torch.dtype, products: str
) -> None:
    case = make_case(dtype, isa=isa, products=products)
    out, pool = run_stack(case)
    expected_out, expected_pool = per_operator(case)
    assert torch.equal(out, expected_out)
    assert torch.equal(pool, expected_pool)


@needs_kernel
@pytest.mark.parametrize("quant_isa", quant_dot_cpu.supported_isas())
def test_int8_products_run_with_each_of_their_instruction_sets(quant_isa: str) -> None:
    case = make_case(torch.float32, products="panels", quant_isa=quant_isa)
    assert case.stack.quant_isa == quant_isa
    out, pool = run_stack(case)
    expected_out, expected_pool = per_operator(case)
    assert torch.equal(out, expected_out) and torch.equal(pool, expected_pool)


@needs_kernel
@each_isa
@pytest.mark.parametrize("products", PRODUCTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_the_float64_oracle(isa: str, dtype: torch.dtype, seed: int, products: str) -> None:
    """Float32: equal up to summation order (errors ~1e-6 seen). Bfloat16: an intermediate
    value may round to the neighbouring bfloat16 (2^-8 relative) and carry it on (up to 6e-5
    seen over seeds 0-3); the bound leaves room for that, far below what a wrong head, layer,
    window or slot gives (O(1)). With int8 products, an activation the oracle computes a float32
    rounding away from the midpoint between two of its block's 8-bit codes may take the other
    code (an error of max|x| / 127 of its block times the weight), carried on like a bfloat16
    rounding (up to 3.5e-3 seen in float32): the bfloat16 bound."""
    case = make_case(dtype, seed=seed, isa=isa, products=products)
    out, pool = run_stack(case)
    expected_out, expected_pool = oracle(case)
    bound = 1e-5 if dtype == torch.float32 and products == "q4" else 2e-2
    torch.testing.assert_close(out, expected_out, atol=bound, rtol=bound)
    torch.testing.assert_close(pool.float(), expected_pool.float(), atol=bound, rtol=bound)
    written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    written[case.slots] = True
    flat = pool.view(pool.shape[0], 2, NUM_BLOCKS * BLOCK_SIZE, -1)
    before = case.kv_pool.view_as(flat)
    assert torch.equal(flat[:, :, ~written], before[:, :, ~written]), "only this step's slots"
    assert not torch.equal(flat[:, :, written], before[:, :, written])


@needs_kernel
@each_isa
def test_sliding_window_is_applied_per_layer(isa: str) -> None:
    """The same step with layer 1's window removed gives other results (the window of 3 cuts
    contexts of 5, 9 and 14 keys), and the oracle follows both."""
    windowed = make_case(torch.float32, windows=(None, 3, None), isa=isa)
    full = make_case(torch.float32, windows=(None, None, None), isa=isa)
    assert not torch.equal(run_stack(windowed)[0], run_stack(full)[0])
    torch.testing.assert_close(run_stack(full)[0], oracle(full)[0], atol=1e-5, rtol=1e-5)


@needs_kernel
@each_isa
@pytest.mark.parametrize("products", PRODUCTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_does_not_depend_on_the_rest_of_the_batch(
    isa: str, dtype: torch.dtype, products: str
) -> None:
    lens = (5, 9, 1, 14, 7, 3, 11, 2, 6, 10)
    case = make_case(dtype, context_lens=lens, isa=isa, products=products)
    together, _ = run_stack(case)
    for rows in ([1], [3, 0], [9, 2, 5]):
        alone, _ = run_stack(case.select(rows))
        assert torch.equal(alone, together[rows])


@needs_kernel
@each_isa
@pytest.mark.parametrize("products", PRODUCTS)
def test_thread_count_does_not_change_the_bits(isa: str, products: str) -> None:
    case = make_case(torch.bfloat16, context_lens=(5, 9, 1, 14, 7, 3), isa=isa, products=products)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_stack(case)
        torch.set_num_threads(2)
        two = run_stack(case)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


@needs_kernel
def test_bad_operands_are_refused() -> None:
    case = make_case(torch.bfloat16)
    layer = case.stack.layers[0]
    final = case.stack.final_norm
    with pytest.raises(ValueError, match="qkv"):
        DecoderStack([dataclasses.replace(layer, qkv=layer.out)], SHAPE, final, torch.bfloat16)
    with pytest.raises(ValueError, match="input norm"):
        DecoderStack([layer], SHAPE, final, torch.float32)  # norms are bfloat16
    with pytest.raises(ValueError, match="head_dim"):
        DecoderStack([layer], dataclasses.replace(SHAPE, head_dim=24), final, torch.bfloat16)
    with pytest.raises(ValueError, match="activations"):
        DecoderStack([layer], SHAPE, final, torch.float16)
    with pytest.raises(ValueError, match="instruction set"):
        DecoderStack([layer], SHAPE, final, torch.bfloat16, isa="sse2")
    stack, residual = case.stack, case.residual.clone()
    assert not stack.accepts(residual, case.kv_pool.float())  # another dtype
    assert not stack.accepts(residual.to(torch.bfloat16), case.kv_pool)
    assert not stack.accepts(residual, case.kv_pool[:2])  # fewer layers than the stack
    with pytest.raises(ValueError, match="KV pool"):
        stack.run(residual, case.cos, case.sin, case.slots, case.kv_pool[:2], case.decodes)
    with pytest.raises(ValueError, match="cos"):
        stack.run(residual, case.cos[:, :16], case.sin, case.slots, case.kv_pool, case.decodes)
    with pytest.raises(ValueError, match="slots"):
        stack.run(residual, case.cos, case.sin, case.slots.int(), case.kv_pool, case.decodes)
    with pytest.raises(ValueError, match="decode"):
        stack.run(residual[:2], case.cos[:2], case.sin[:2], case.slots[:2], case.kv_pool,
                  case.decodes)  # fmt: skip
