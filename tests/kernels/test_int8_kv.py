"""Int8 KV caches (`pagedserve_kernels.kv_quant`): the codes and scales against their definition
(float64), the native decode kernel (each instruction set) and the plain-torch path against the
plain-torch oracle (`reference.paged_attention`) over the dequantized caches, writes, and the
block operations carrying the scales with the codes."""

from __future__ import annotations

import pytest
import torch

import pagedserve_kernels
from pagedserve_kernels import attention_cpu, kv_quant, reference, torch_cpu
from pagedserve_kernels.attention_cpu import DecodeRows
from tests.kernels.cases import TOLERANCE, AttentionCase, make_case
from tests.kernels.cpu_features import each_isa, needs_vector_kernels


def _int8_case(case: AttentionCase, query_dtype: torch.dtype) -> AttentionCase:
    return AttentionCase(
        case.query.to(query_dtype),
        kv_quant.quantize_int8(case.k_cache),
        kv_quant.quantize_int8(case.v_cache),
        case.cu_query_lens,
        case.context_lens,
        case.block_tables,
        case.scale,
    )


def _oracle(case: AttentionCase, window: int | None = None) -> torch.Tensor:
    """Float32 attention over the values the int8 caches hold (independent of the kernels)."""
    return reference.paged_attention(
        case.query.float(),
        kv_quant.dequantize_int8(case.k_cache, torch.float32),
        kv_quant.dequantize_int8(case.v_cache, torch.float32),
        sliding_window=window,
        **case.kwargs(),
    )


def _bound(dtype: torch.dtype) -> float:
    return 2e-5 if dtype == torch.float32 else 2.0**-7


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_codes_and_scales_follow_their_definition(head_dim: int) -> None:
    generator = torch.Generator().manual_seed(head_dim)
    values = torch.randn((50, 3, head_dim), generator=generator, dtype=torch.float64) * 4
    values[0, 0] = 0.0  # an all-zero vector keeps scale 0 and codes 0
    rows = kv_quant.quantize_int8(values)
    assert rows.dtype == torch.int8 and rows.shape == (50, 3, head_dim + kv_quant.SCALE_BYTES)
    scales = kv_quant.int8_scales(rows).double()
    absmax = values.abs().amax(-1, keepdim=True)
    # the scale is absmax / 127 rounded to bfloat16 (8 significant bits)
    torch.testing.assert_close(scales, absmax / 127, rtol=2.0**-8, atol=0.0)
    codes = rows[..., :head_dim].double()
    assert codes.abs().max() <= 127
    error = (codes * scales - values).abs()
    # half a step, plus what the clamp at 127 can cut when the scale rounded down
    assert bool((error <= scales * (0.5 + 2.0**-7) + 1e-12).all())
    assert bool((rows[0, 0] == 0).all())
    back = kv_quant.dequantize_int8(rows, torch.float32)
    torch.testing.assert_close(back.double(), codes * scales, rtol=0, atol=0)


@needs_vector_kernels
@each_isa
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("block_size", "group", "head_dim", "kv_heads"),
    [(16, 3, 64, 3), (1, 1, 32, 1), (5, 8, 128, 2), (32, 2, 256, 1), (16, 1, 96, 8)],
)
def test_native_kernel_reads_int8_codes_as_the_oracle_does(
    isa: str, query_dtype: torch.dtype, block_size: int, group: int, head_dim: int, kv_heads: int
) -> None:
    decodes = [(1, 1), (15, 1), (16, 1), (17, 1), (100, 1), (333, 1)]
    case = make_case(
        decodes,
        block_size=block_size,
        head_dim=head_dim,
        group=group,
        dtype=torch.float32,
        num_kv_heads=kv_heads,
        seed=head_dim + group,
    )
    case = _int8_case(case, query_dtype)
    assert attention_cpu.accepts(case.query, case.k_cache, case.v_cache, case.query)
    for window in (None, 7):
        out = torch.full_like(case.query, float("nan"))
        rows = DecodeRows.of(
            list(range(len(decodes))),
            case.cu_query_lens.long(),
            case.context_lens.long(),
            case.block_tables.long(),
        )
        attention_cpu.decode_attention(
            case.query, case.k_cache, case.v_cache, rows, case.scale, window, out, isa
        )
        bound = _bound(query_dtype)
        torch.testing.assert_close(out.float(), _oracle(case, window), atol=bound, rtol=bound)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
def test_public_attention_over_int8_caches_matches_the_oracle(
    native: bool, query_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill chunks and decodes through `pagedserve_kernels.paged_attention`, by the native
    kernel and by the torch path (forced) alike."""
    if native:
        assert attention_cpu.available()  # every CPU kind we run on builds it
    else:
        monkeypatch.setattr(torch_cpu.attention_cpu, "accepts", lambda *args: False)
    lengths = [(41, 41), (33, 1), (16, 0), (70, 1), (65, 5), (3, 1), (20, 1), (9, 1), (18, 1)]
    case = make_case(lengths, block_size=16, head_dim=64, group=3, dtype=torch.float32)
    case = _int8_case(case, query_dtype)
    for window in (None, 10):
        got = pagedserve_kernels.paged_attention(
            case.query, case.k_cache, case.v_cache, sliding_window=window, **case.kwargs()
        )
        # the torch path decodes the gathered blocks to the query's dtype and computes in it
        bound = _bound(query_dtype) if native else TOLERANCE[query_dtype]
        torch.testing.assert_close(got.float(), _oracle(case, window), atol=bound, rtol=bound)


def test_int8_attention_stays_near_float_attention() -> None:
    """What quantizing costs the attention output itself (against float32 caches)."""
    lengths = [(300, 1), (64, 1), (129, 1)]
    case = make_case(lengths, block_size=16, head_dim=64, group=2, dtype=torch.float32)
    exact = reference.paged_attention(case.query, case.k_cache, case.v_cache, **case.kwargs())
    got = pagedserve_kernels.paged_attention(
        case.query,
        kv_quant.quantize_int8(case.k_cache),
        kv_quant.quantize_int8(case.v_cache),
        **case.kwargs(),
    )
    relative = (got - exact).norm() / exact.norm()
    assert relative < 0.02


def test_write_kv_stores_codes_and_scales_and_touches_nothing_else() -> None:
    pool = pagedserve_kernels.allocate_kv_pool(
        num_layers=1,
        num_blocks=4,
        block_size=4,
        num_kv_heads=2,
        head_dim=32,
        dtype=torch.int8,
        device="cpu",
    )
    assert pool.shape[-1] == 32 + kv_quant.SCALE_BYTES
    k_cache, v_cache = pool[0, 0], pool[0, 1]
    before = pool.clone()
    key = torch.randn(3, 2, 32, dtype=torch.bfloat16)
    value = torch.randn(3, 2, 32, dtype=torch.bfloat16)
    slots = torch.tensor([5, -1, 14])
    pagedserve_kernels.write_kv(key, value, k_cache, v_cache, slots)
    flat_k = k_cache.view(-1, 2, 34)
    flat_v = v_cache.view(-1, 2, 34)
    assert torch.equal(flat_k[5], kv_quant.quantize_int8(key[0]))
    assert torch.equal(flat_v[14], kv_quant.quantize_int8(value[2]))
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[[5, 14]] = False
    assert torch.equal(flat_k[untouched], before[0, 0].view(-1, 2, 34)[untouched])


def test_copy_and_swap_carry_the_scales() -> None:
    shape = {"num_layers": 2, "num_blocks": 3, "block_size": 4, "num_kv_heads": 1, "head_dim": 32}
    pool = pagedserve_kernels.allocate_kv_pool(**shape, dtype=torch.int8, device="cpu")
    pool.copy_(kv_quant.quantize_int8(torch.randn(*pool.shape[:-1], 32)))
    other = pagedserve_kernels.allocate_kv_pool(**shape, dtype=torch.int8, device="cpu")
    pagedserve_kernels.swap_blocks(pool, other, torch.tensor([[1, 2]]))
    assert torch.equal(other[:, :, 2], pool[:, :, 1])
    pagedserve_kernels.copy_blocks(pool, torch.tensor([[0, 2]]))
    assert torch.equal(
        kv_quant.dequantize_int8(pool[:, :, 2], torch.float32),
        kv_quant.dequantize_int8(pool[:, :, 0], torch.float32),
    )


def test_storage_dtypes_of_each_setting() -> None:
    assert kv_quant.storage_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_quant.storage_dtype("int8", torch.bfloat16) == torch.int8
    assert kv_quant.storage_dtype("fp8", torch.float16) == torch.float8_e4m3fn
    assert kv_quant.canonical("fp8") == kv_quant.canonical("fp8_e4m3") == "fp8_e4m3"
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8_e5m2'"):
        kv_quant.canonical("fp8_e5m2")


def test_block_transfers_carry_the_scales_and_refuse_other_dtypes() -> None:
    """The bytes a peer pull moves (`workers.block_io`): an int8 block arrives with its scales,
    and rows of a bfloat16 pool do not fit an int8 one."""
    from workers.block_io import read_blocks, write_blocks

    shape = {"num_layers": 2, "num_blocks": 4, "block_size": 4, "num_kv_heads": 2, "head_dim": 32}
    source = pagedserve_kernels.allocate_kv_pool(**shape, dtype=torch.int8, device="cpu")
    source.copy_(kv_quant.quantize_int8(torch.randn(*source.shape[:-1], 32)))
    target = pagedserve_kernels.allocate_kv_pool(**shape, dtype=torch.int8, device="cpu")
    assert write_blocks(target, [3, 0], read_blocks(source, [1, 2])) == 2
    assert torch.equal(target[:, :, 3], source[:, :, 1])
    assert torch.equal(target[:, :, 0], source[:, :, 2])
    bf16 = pagedserve_kernels.allocate_kv_pool(**shape, dtype=torch.bfloat16, device="cpu")
    with pytest.raises(ValueError, match="do not fit"):
        write_blocks(target, [0], read_blocks(bf16, [0]))
