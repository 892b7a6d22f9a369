"""A decode step's whole decoder stack in one native call on the CPU
(`pagedserve_kernels/csrc/decoder_stack_cpu.cpp`): every layer's norms, products on quantized
weights, rotary embeddings with the KV write, paged decode attention and silu, then the final
norm.

The per-operator path (`workers.model` with `NativeCpuLayerOps` and the 4-bit `DenseMatmul`)
makes ~20 Python-level calls per layer; at decode batch sizes on a few cores those cost as much
as the arithmetic. This library chains the same native kernels with no Python in between.

Invariants: for the same rows, `DecoderStack.run` writes the same KV bits and returns the same
hidden states as the per-operator path where every linear layer takes the kernel its weight is
laid out for (a `Q4Weight`: the exact 4-bit kernel; a `PanelWeight`: int8-quantized
activations, `pagedserve_kernels.quant_dot_cpu`; the same kernels in the same order, each rounding
once to the activations' dtype); each row's
result does not depend on the other rows. Weights are referenced, not copied: a `DecoderStack`
keeps the tensors it was built from alive and must be rebuilt if any is replaced. The library
is built by pip at install time for AVX-512 and for AVX2 with FMA (`supported_isas()`, fastest
first; `DecoderStack(..., isa=)` forces one, so tests run each this CPU has); `available()` is
false where it was not built or the CPU lacks AVX2 and FMA.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from pagedserve_kernels import quant_dot_cpu
from pagedserve_kernels.attention_cpu import MAX_GROUP, MAX_HEAD_DIM, DecodeRows
from pagedserve_kernels.native import FLAG, POINTER, SIZE, NativeLibrary
from pagedserve_kernels.q4_cpu import Q4Weight
from pagedserve_kernels.quant_dot_cpu import PanelWeight

StackWeight = Q4Weight | PanelWeight
"""A product's weights as the stack takes them: exact 4-bit codes, or panels for int8 products."""


def panel_bits(weight: StackWeight) -> int:
    """The bits of a product's panel codes (int8 products), 0 for the exact 4-bit layout: what
    the library's table says of each product."""
    return weight.bits if isinstance(weight, PanelWeight) else 0


STACK_DTYPES = (torch.float32, torch.bfloat16)
"""The activations' dtypes it takes (the norms' weights and the KV cache share it)."""


@functools.cache
def _native() -> NativeLibrary:
    """The library as this process loaded it (`pagedserve_kernels.native.NativeLibrary`)."""
    stack = [
        FLAG, FLAG,  # instruction set, the int8 products' (quant_dot's numbering)
        POINTER, SIZE, FLAG,  # layer table, layers, bfloat16
        SIZE, SIZE, SIZE, SIZE, SIZE,  # hidden, query heads, kv heads, head_dim, intermediate
        ctypes.c_float, ctypes.c_float,  # eps, attention scale
        POINTER, SIZE,  # residual, rows
        POINTER, POINTER, POINTER,  # cos, sin, slots
        POINTER, SIZE, SIZE,  # kv pool, bytes per layer, value cache offset in bytes
        POINTER, POINTER, POINTER, SIZE, SIZE,  # rows, context_lens, tables, stride, block_size
        POINTER, POINTER,  # final norm weight, out
    ]  # fmt: skip
    native = NativeLibrary.load("pagedserve_kernels._decoder_stack_cpu", "decoder_stack_supported",
                               {"decoder_stack": stack}, "decoder_stack_isa_supported")  # fmt: skip
    if native.handle is not None:
        native.handle.decoder_stack_fields.restype = SIZE
    return native


def available() -> bool:
    """Whether the native library was built and this CPU runs it (AVX2 and FMA at least)."""
    return _native().available()


def supported_isas() -> tuple[str, ...]:
    """The instruction sets (`pagedserve_kernels.native.VECTOR_ISAS`) this CPU runs the library
    with, fastest first."""
    return _native().isas


def best_isa() -> str | None:
    """The fastest instruction set this CPU runs the library with (None: none)."""
    return _native().best_isa()


@dataclass(frozen=True)
class StackLayer:
    """One pre-norm decoder layer's weights: norms `[hidden]` in the activations' dtype, the
    fused QKV (`[(num_q + 2 num_kv) head_dim, hidden]`), output (`[hidden, num_q head_dim]`),
    fused gate/up (`[2 intermediate, hidden]`) and down (`[hidden, intermediate]`) products as
    `StackWeight`s, and the layer's sliding window (None: full context)."""

    input_norm: torch.Tensor
    qkv: StackWeight
    out: StackWeight
    post_norm: torch.Tensor
    gate_up: StackWeight
    down: StackWeight
    window: int | None

    @property
    def products(self) -> tuple[StackWeight, StackWeight, StackWeight, StackWeight]:
        return (self.qkv, self.out, self.gate_up, self.down)


@dataclass(frozen=True)
class StackShape:
    """The geometry every layer shares."""

    hidden: int
    num_q: int
    num_kv: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float

    def check(self) -> None:
        """ValueError for a geometry the kernels do not take."""
        if min(self.hidden, self.num_q, self.num_kv, self.head_dim, self.intermediate) < 1:
            raise ValueError(f"decoder stack: non-positive size in {self}")
        if self.num_q % self.num_kv or self.num_q // self.num_kv > MAX_GROUP:
            raise ValueError(f"decoder stack: {self.num_q} query heads over {self.num_kv} KV "
                             f"heads (groups of at most {MAX_GROUP})")  # fmt: skip
        if self.head_dim % 16 or self.head_dim > MAX_HEAD_DIM:
            raise ValueError(f"decoder stack: head_dim {self.head_dim} is not a multiple of 16 "
                             f"up to {MAX_HEAD_DIM}")  # fmt: skip
        widths = (self.hidden, self.num_q * self.head_dim, self.intermediate)
        if any(width % 32 for width in widths):
            raise ValueError(f"decoder stack: product inputs {widths} not multiples of 32")


class DecoderStack:
    """A model's layers as the library reads them (see the module doc); `run` per decode step."""

    def __init__(
        self,
        layers: list[StackLayer],
        shape: StackShape,
        final_norm: torch.Tensor,
        dtype: torch.dtype,
        isa: str | None = None,
        quant_isa: str | None = None,
    ) -> None:
        """ValueError if the library cannot run these weights as given, or `isa` (the
        instruction set every step runs with: one of `supported_isas()`, None: the fastest) is
        not one this CPU has. Panel weights run with `quant_isa` (one of
        `quant_dot_cpu.supported_isas()`, None: the fastest)."""
        native = _native()
        library = native.require(
            "the decoder stack library is not available (not built, or no AVX2 and FMA)"
        )
        native.isa_number(isa)  # refuses an instruction set this CPU lacks
        self.isa: str = isa or str(best_isa())
        self.quant_isa: str | None = None
        """The int8 products' instruction set; None where no product has panels."""
        if any(panel_bits(w) for layer in layers for w in layer.products):
            if not quant_dot_cpu.available():
                raise ValueError("decoder stack: panel weights need the int8 product library")
            self.quant_isa = quant_isa or quant_dot_cpu.best_isa()
            self._quant_isa_number = quant_dot_cpu.isa_number(self.quant_isa)
        else:
            self._quant_isa_number = 0
        if dtype not in STACK_DTYPES:
            raise ValueError(f"decoder stack: activations {dtype}, not one of {STACK_DTYPES}")
        shape.check()
        _check_vector("final norm", final_norm, shape.hidden, torch.float32)
        self.shape = shape
        self.dtype = dtype
        self.final_norm = final_norm
        self.layers = list(layers)  # keeps every referenced tensor alive
        fields = int(library.decoder_stack_fields())
        table = torch.zeros(len(layers), fields, dtype=torch.int64)
        for index, layer in enumerate(layers):
            row = _layer_row(layer, shape, dtype)
            if len(row) != fields:
                raise RuntimeError(f"decoder stack: {len(row)} fields, the library has {fields}")
            table[index] = torch.tensor(row, dtype=torch.int64)
        self.table = table

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def accepts(self, residual: torch.Tensor, kv_pool: torch.Tensor) -> bool:
        """Whether `run` takes this residual stream and KV pool."""
        cache_shape = (self.shape.num_kv, self.shape.head_dim)
        return (
            residual.dtype == torch.float32
            and residual.device.type == "cpu"
            and residual.dim() == 2
            and residual.shape[1] == self.shape.hidden
            and residual.is_contiguous()
            and kv_pool.dtype == self.dtype
            and kv_pool.device.type == "cpu"
            and kv_pool.dim() == 6
            and kv_pool.shape[:2] == (self.num_layers, 2)
            and tuple(kv_pool.shape[4:]) == cache_shape
            and kv_pool.is_contiguous()
        )

    def run(
        self,
        residual: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        kv_pool: torch.Tensor,
        decodes: DecodeRows,
    ) -> torch.Tensor:
        """The final-normed hidden states `[rows, hidden]` (float32) of `rows` decodes, one
        token each (token row i is decode i); writes each token's KV to `slots[i]` of every
        layer's caches and updates `residual` in place.

        `residual` float32 `[rows, hidden]` (the embeddings), `cos` / `sin` float32
        `[rows, head_dim]`, `slots` int64 `[rows]` (-1: no write), `kv_pool`
        `[layers, 2, blocks, block_size, num_kv, head_dim]` (as `accepts` requires), `decodes`
        validated against it (`pagedserve_kernels.prepare_attention`)."""
        library = _native().handle
        assert library is not None, "a DecoderStack exists only where the library loads"
        if not self.accepts(residual, kv_pool):
            raise ValueError("decoder stack: residual or KV pool it does not take (see accepts)")
        rows, head_dim = residual.shape[0], self.shape.head_dim
        if decodes.rows.shape[0] != rows or not bool(
            torch.equal(decodes.rows, torch.arange(rows, dtype=torch.int64))
        ):
            raise ValueError("decoder stack: every token row must be a decode, in order")
        for name, table in (("cos", cos), ("sin", sin)):
            if table.dtype != torch.float32 or table.shape != (rows, head_dim):
                raise ValueError(f"decoder stack: {name} must be float32 [{rows}, {head_dim}]")
        if slots.dtype != torch.int64 or slots.shape != (rows,):
            raise ValueError(f"decoder stack: slots must be int64 [{rows}]")
        cos, sin, slots = cos.contiguous(), sin.contiguous(), slots.contiguous()
        element = kv_pool.element_size()
        out = torch.empty(rows, self.shape.hidden, dtype=torch.float32)
        shape = self.shape
        status = library.decoder_stack(
            _native().isa_number(self.isa),
            self._quant_isa_number,
            self.table.data_ptr(),
            self.num_layers,
            int(self.dtype == torch.bfloat16),
            shape.hidden,
            shape.num_q,
            shape.num_kv,
            head_dim,
            shape.intermediate,
            shape.eps,
            shape.scale,
            residual.data_ptr(),
            rows,
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            kv_pool.data_ptr(),
            kv_pool.stride(0) * element,
            kv_pool.stride(1) * element,
            decodes.rows.data_ptr(),
            decodes.context_lens.data_ptr(),
            decodes.block_tables.data_ptr(),
            decodes.block_tables.stride(0),
            kv_pool.shape[3],
            self.final_norm.data_ptr(),
            out.data_ptr(),
        )
        if status != 0:
            raise RuntimeError(f"decoder_stack failed with status {status}")
        return out


def _check_vector(name: str, tensor: torch.Tensor, size: int, dtype: torch.dtype) -> None:
    if tensor.shape != (size,) or tensor.dtype != dtype or tensor.device.type != "cpu":
        raise ValueError(f"decoder stack: {name} must be {dtype} [{size}] on the CPU, got "
                         f"{tensor.dtype} {tuple(tensor.shape)} on {tensor.device}")  # fmt: skip
    if not tensor.is_contiguous():
        raise ValueError(f"decoder stack: {name} must be contiguous")


def _check_weight(name: str, weight: StackWeight, rows: int, cols: int) -> None:
    if weight.shape != (rows, cols):
        raise ValueError(f"decoder stack: {name} is {weight.shape}, expected {(rows, cols)}")
    for part in (weight.codes, weight.scales, weight.mins):
        if not part.is_contiguous() or part.device.type != "cpu":
            raise ValueError(f"decoder stack: {name}'s tensors must be contiguous on the CPU")


def _layer_row(layer: StackLayer, shape: StackShape, dtype: torch.dtype) -> list[int]:
    """The layer's row of the library's table, in the order of its `Field` enum."""
    q_width = shape.num_q * shape.head_dim
    qkv_rows = (shape.num_q + 2 * shape.num_kv) * shape.head_dim
    _check_vector("input norm", layer.input_norm, shape.hidden, dtype)
    _check_vector("post-attention norm", layer.post_norm, shape.hidden, dtype)
    _check_weight("qkv", layer.qkv, qkv_rows, shape.hidden)
    _check_weight("out", layer.out, shape.hidden, q_width)
    _check_weight("gate_up", layer.gate_up, 2 * shape.intermediate, shape.hidden)
    _check_weight("down", layer.down, shape.hidden, shape.intermediate)
    if layer.window is not None and layer.window < 1:
        raise ValueError(f"decoder stack: sliding window {layer.window}")
    row = [layer.input_norm.data_ptr()]
    for weight in (layer.qkv, layer.out):
        row += [weight.codes.data_ptr(), weight.scales.data_ptr(), weight.mins.data_ptr()]
    row.append(layer.post_norm.data_ptr())
    for weight in (layer.gate_up, layer.down):
        row += [weight.codes.data_ptr(), weight.scales.data_ptr(), weight.mins.data_ptr()]
    return [*row, layer.window or 0, *(panel_bits(weight) for weight in layer.products)]
