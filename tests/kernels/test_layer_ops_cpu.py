"""The native elementwise layer ops (`pagedserve_kernels.layer_ops_cpu`) against float64 oracles:
each result is the exact value rounded once to its dtype (within float32's own error), and every
cache entry it should not write keeps its bits."""

from __future__ import annotations

import pytest
import torch

from pagedserve_kernels import layer_ops_cpu
from tests.kernels.cpu_features import (
    cpu_has_avx2_fma,
    cpu_vector_isas,
    each_isa,
    needs_vector_kernels,
)

needs_kernel = needs_vector_kernels


def test_library_is_built_wherever_the_cpu_runs_it() -> None:
    assert layer_ops_cpu.available() == cpu_has_avx2_fma()
    assert layer_ops_cpu.supported_isas() == cpu_vector_isas()


def _assert_rounded_once(got: torch.Tensor, exact: tuple[torch.Tensor, torch.Tensor]) -> None:
    """`got` is the exact value (float64) rounded once to `got`'s dtype, up to float32
    arithmetic: within half a bfloat16 step of it (2^-8 relative; float32: none), plus a few
    float32 steps of the terms' magnitude (`exact` = (value, sum of the terms' magnitudes))."""
    value, magnitude = exact
    relative = 2.0**-8 if got.dtype == torch.bfloat16 else 0.0
    error = (got.double() - value).abs()
    bound = relative * value.abs() + 4 * 2.0**-24 * magnitude + 1e-30
    assert bool((error <= bound).all()), float((error - bound).max())


def _rms_norm_exact(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return weight.double() * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@needs_kernel
@each_isa
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("delta_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "hidden"), [(1, 576), (5, 100), (300, 576)])
def test_add_rms_norm(
    isa: str, out_dtype: torch.dtype, delta_dtype: torch.dtype | None, rows: int, hidden: int
) -> None:
    generator = torch.Generator().manual_seed(rows + hidden)
    residual = torch.randn(rows, hidden, generator=generator) * 3
    delta = None
    if delta_dtype is not None:
        delta = torch.randn(rows, hidden, generator=generator).to(delta_dtype)
    weight = (torch.rand(hidden, generator=generator) + 0.5).to(out_dtype)
    expected_residual = residual if delta is None else residual + delta.float()
    updated = residual.clone()
    out = layer_ops_cpu.add_rms_norm(updated, delta, weight, 1e-5, out_dtype, isa=isa)
    assert torch.equal(updated, expected_residual)  # one float32 add, as torch's
    assert out.dtype == out_dtype and out.shape == (rows, hidden)
    exact = _rms_norm_exact(expected_residual, weight, 1e-5)
    if out_dtype == torch.float32:
        torch.testing.assert_close(out.double(), exact, rtol=1e-6, atol=1e-7)
    else:
        # within float32's error of the normalized value, then rounded once to bfloat16
        torch.testing.assert_close(out.double(), exact, rtol=2.0**-8 + 1e-6, atol=1e-7)


def _rotate_exact(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x cos + rotate_half(x) sin, |x cos| + |rotate_half(x) sin|) in float64."""
    x, cos, sin = x.double(), cos.double()[:, None], sin.double()[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin, (x * cos).abs() + (rotated * sin).abs()


@needs_kernel
@each_isa
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_q", "num_kv", "head_dim"), [(9, 3, 64), (4, 4, 128), (2, 1, 48)])
def test_rotary_write_kv(
    isa: str, dtype: torch.dtype, num_q: int, num_kv: int, head_dim: int
) -> None:
    generator = torch.Generator().manual_seed(head_dim)
    tokens, blocks, block_size = 6, 5, 4
    qkv = torch.randn(tokens, (num_q + 2 * num_kv) * head_dim, generator=generator).to(dtype)
    positions = torch.tensor([0, 7, 100, 3, 4095, 12])
    angles = positions[:, None].float() * torch.rand(head_dim // 2, generator=generator)
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    slots = torch.tensor([5, -1, 0, 19, 7, -1])
    k_cache = torch.randn(blocks, block_size, num_kv, head_dim, generator=generator).to(dtype)
    v_cache = torch.randn(blocks, block_size, num_kv, head_dim, generator=generator).to(dtype)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    heads = (num_q, num_kv, head_dim)
    q = layer_ops_cpu.rotary_write_kv(qkv, heads, cos, sin, slots, k_cache, v_cache, isa=isa)
    split = qkv.view(tokens, num_q + 2 * num_kv, head_dim)
    query, key, value = (
        split[:, :num_q],
        split[:, num_q : num_q + num_kv],
        split[:, num_q + num_kv :],
    )
    _assert_rounded_once(q, _rotate_exact(query, cos, sin))
    k_flat, v_flat = k_cache.view(-1, num_kv, head_dim), v_cache.view(-1, num_kv, head_dim)
    written = slots >= 0
    rotated_keys, magnitudes = _rotate_exact(key, cos, sin)
    _assert_rounded_once(k_flat[slots[written]], (rotated_keys[written], magnitudes[written]))
    assert torch.equal(v_flat[slots[written]], value[written])
    untouched = torch.ones(blocks * block_size, dtype=torch.bool)
    untouched[slots[written]] = False
    assert torch.equal(k_flat[untouched], k_before.view(-1, num_kv, head_dim)[untouched])
    assert torch.equal(v_flat[untouched], v_before.view(-1, num_kv, head_dim)[untouched])


@needs_kernel
@each_isa
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "width"), [(1, 1536), (3, 40), (64, 1536)])
def test_silu_mul(isa: str, dtype: torch.dtype, rows: int, width: int) -> None:
    generator = torch.Generator().manual_seed(width)
    gate_up = (torch.randn(rows, 2 * width, generator=generator) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).to(dtype)  # exp's clamped range
    out = layer_ops_cpu.silu_mul(gate_up, isa=isa)
    gate, up = gate_up.double().chunk(2, dim=-1)
    exact = gate * torch.sigmoid(gate) * up
    if dtype == torch.float32:  # the vector exp and a division: a few float32 steps
        torch.testing.assert_close(out.double(), exact, rtol=1e-6, atol=1e-30)
    else:
        torch.testing.assert_close(out.double(), exact, rtol=2.0**-8 + 1e-6, atol=1e-30)


@needs_kernel
def test_bad_operands_are_refused() -> None:
    residual = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="weight"):
        layer_ops_cpu.add_rms_norm(residual, None, torch.ones(63), 1e-5, torch.float32)
    with pytest.raises(ValueError, match="delta"):
        layer_ops_cpu.add_rms_norm(
            residual, torch.zeros(2, 32), torch.ones(64), 1e-5, torch.float32
        )
    cache = torch.zeros(2, 4, 1, 64)
    cos = torch.zeros(3, 64)
    with pytest.raises(ValueError, match="qkv width"):
        layer_ops_cpu.rotary_write_kv(
            torch.zeros(3, 200),
            (1, 1, 64),
            cos,
            cos,
            torch.zeros(3, dtype=torch.int64),
            cache,
            cache,
        )
    with pytest.raises(ValueError, match="slots"):
        layer_ops_cpu.rotary_write_kv(
            torch.zeros(3, 192),
            (1, 1, 64),
            cos,
            cos,
            torch.zeros(3, dtype=torch.int32),
            cache,
            cache,
        )
    with pytest.raises(ValueError, match="odd width"):
        layer_ops_cpu.silu_mul(torch.zeros(2, 7))
    assert not layer_ops_cpu.fits(torch.zeros(4, 4).half())
    assert not layer_ops_cpu.fits(torch.zeros(4, 8)[:, ::2])
