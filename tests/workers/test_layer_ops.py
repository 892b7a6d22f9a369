"""`workers.layer_ops`: the native CPU ops compute what the plain-torch ops compute (float32: up
to summation order; bfloat16: within the one rounding torch adds between operators), keep the
per-layer checks of `write_kv`, and fall back to torch for operands the library does not take."""

from __future__ import annotations

import pytest
import torch

from pagedserve_kernels import PagedAttentionStep, layer_ops_cpu, prepare_attention
from tests.kernels.cpu_features import cpu_has_avx2_fma, each_isa, needs_vector_kernels
from workers.config import RopeSpec
from workers.layer_ops import NativeCpuLayerOps, TorchLayerOps, layer_ops_for
from workers.layers import RMSNorm
from workers.rope import RotaryEmbedding

needs_library = needs_vector_kernels  # a CPU with AVX2 and FMA runs it: a missing build fails

BF16_STEP = 2.0**-7  # torch in bfloat16 rounds between operators: up to about one step apart


def _close(native: torch.Tensor, plain: torch.Tensor) -> None:
    tolerance = 1e-5 if native.dtype == torch.float32 else 2 * BF16_STEP
    assert native.dtype == plain.dtype and native.shape == plain.shape
    torch.testing.assert_close(native.float(), plain.float(), rtol=tolerance, atol=tolerance)


def test_a_cpu_model_gets_the_native_ops_where_built() -> None:
    chosen = layer_ops_for(torch.device("cpu"))
    assert isinstance(chosen, NativeCpuLayerOps) == layer_ops_cpu.available() == cpu_has_avx2_fma()
    assert isinstance(layer_ops_for(torch.device("meta")), TorchLayerOps)


@needs_library
@each_isa
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_norm_matches_torch(isa: str, dtype: torch.dtype) -> None:
    norm = RMSNorm(96, 1e-6, dtype)
    norm.weight.data = torch.rand(96, generator=torch.Generator().manual_seed(1)).to(dtype) + 0.5
    residual = torch.randn(7, 96)
    delta = torch.randn(7, 96).to(dtype)
    plain_residual, plain = TorchLayerOps().add_norm(residual.clone(), delta, norm)
    native_residual, native = NativeCpuLayerOps(isa).add_norm(residual.clone(), delta, norm)
    assert torch.equal(native_residual, plain_residual)
    _close(native, plain)
    # nothing pending: the norm alone
    _close(NativeCpuLayerOps(isa).add_norm(residual, None, norm)[1], norm(residual))


def _step(tokens: int, slots: list[int], block_size: int, blocks: int) -> PagedAttentionStep:
    """A step of `tokens` one-token sequences writing `slots` (only the write path is used)."""
    prepared = prepare_attention(
        torch.arange(tokens + 1, dtype=torch.int32),
        torch.ones(tokens, dtype=torch.int32),
        torch.zeros(tokens, 1, dtype=torch.int32),
        num_blocks=blocks,
        block_size=block_size,
        slot_mapping=torch.tensor(slots),
    )
    return PagedAttentionStep(prepared)


@needs_library
@each_isa
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_write_kv_matches_torch(isa: str, dtype: torch.dtype) -> None:
    heads, tokens = (6, 2, 64), 4
    rotary = RotaryEmbedding(RopeSpec(kind="default", theta=10000.0), 64)
    positions = torch.tensor([3, 50, 700, 1])
    qkv = torch.randn(tokens, 10 * 64).to(dtype)
    step = _step(tokens, [9, -1, 0, 30], block_size=8, blocks=4)
    results = []
    for ops in (TorchLayerOps(), NativeCpuLayerOps(isa)):
        k_cache = torch.zeros(4, 8, 2, 64, dtype=dtype)
        v_cache = torch.zeros(4, 8, 2, 64, dtype=dtype)
        cos_sin = ops.cos_sin(rotary, positions, dtype)
        q = ops.rotary_write_kv(qkv, heads, cos_sin, step, k_cache, v_cache)
        results.append((q, k_cache, v_cache))
    (q_plain, k_plain, v_plain), (q_native, k_native, v_native) = results
    _close(q_native, q_plain)
    _close(k_native, k_plain)
    assert torch.equal(v_native, v_plain)


@needs_library
def test_native_rotary_keeps_write_kv_checks() -> None:
    rotary = RotaryEmbedding(RopeSpec(kind="default", theta=10000.0), 64)
    ops = NativeCpuLayerOps()
    step = _step(3, [1, 2, 3], block_size=8, blocks=4)
    cos_sin = ops.cos_sin(rotary, torch.arange(2), torch.float32)
    cache = torch.zeros(4, 8, 1, 64)
    with pytest.raises(ValueError, match="tokens"):  # 2 tokens, the step was prepared for 3
        ops.rotary_write_kv(torch.zeros(2, 3 * 64), (1, 1, 64), cos_sin, step, cache, cache)
    other = torch.zeros(5, 8, 1, 64)
    with pytest.raises(ValueError, match="blocks"):
        cos_sin = ops.cos_sin(rotary, torch.arange(3), torch.float32)
        ops.rotary_write_kv(torch.zeros(3, 3 * 64), (1, 1, 64), cos_sin, step, other, other)


@needs_library
@each_isa
def test_operands_the_library_does_not_take_go_to_torch(isa: str) -> None:
    ops = NativeCpuLayerOps(isa)
    gate_up = torch.randn(3, 2 * 40, dtype=torch.float16)
    _close(ops.silu_mul(gate_up), TorchLayerOps().silu_mul(gate_up))
    strided = torch.randn(3, 4 * 40)[:, ::2]
    assert not strided.is_contiguous()
    torch.testing.assert_close(ops.silu_mul(strided), TorchLayerOps().silu_mul(strided))
    norm = RMSNorm(16, 1e-6, torch.float16)
    residual = torch.randn(2, 16, dtype=torch.float16)  # not the float32 residual stream
    _close(ops.add_norm(residual, None, norm)[1], norm(residual))
