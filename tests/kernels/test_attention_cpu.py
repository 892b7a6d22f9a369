"""The native CPU decode attention (`pagedserve_kernels.attention_cpu`) against the plain-torch
oracle (`pagedserve_kernels.reference`, float32 throughout): decodes and prefill chunks' query
rows, shapes, windows, strides, threads, and what it must leave alone."""

from __future__ import annotations

import pytest
import torch

import pagedserve_kernels
from pagedserve_kernels import attention_cpu, reference
from pagedserve_kernels.attention_cpu import DecodeRows
from pagedserve_kernels.metadata import prepare_attention
from tests.kernels.cases import AttentionCase, make_case
from tests.kernels.cpu_features import (
    cpu_has_avx2_fma,
    cpu_vector_isas,
    each_isa,
    needs_vector_kernels,
)

needs_kernel = needs_vector_kernels


def test_kernel_is_built_wherever_the_cpu_runs_it() -> None:
    """pip builds the library at install time; a missing build on an AVX2 machine is a
    failure here, not a silent fallback to the torch path."""
    assert attention_cpu.available() == cpu_has_avx2_fma()
    assert attention_cpu.supported_isas() == cpu_vector_isas()


def _decode_rows(case: AttentionCase) -> DecodeRows:
    q_lens = (case.cu_query_lens[1:] - case.cu_query_lens[:-1]).tolist()
    decodes = [seq for seq, q_len in enumerate(q_lens) if q_len == 1]
    return DecodeRows.of(
        decodes, case.cu_query_lens.long(), case.context_lens.long(), case.block_tables.long()
    )


def _native(case: AttentionCase, window: int | None = None, isa: str | None = None) -> torch.Tensor:
    """The kernel's result with instruction set `isa`; rows it must not write hold NaN."""
    out = torch.full_like(case.query, float("nan"))
    attention_cpu.decode_attention(
        case.query, case.k_cache, case.v_cache, _decode_rows(case), case.scale, window, out, isa
    )
    return out


def _oracle(case: AttentionCase, window: int | None = None) -> torch.Tensor:
    return reference.paged_attention(
        case.query, case.k_cache, case.v_cache, sliding_window=window, **case.kwargs()
    )


def _assert_matches(got: torch.Tensor, expected: torch.Tensor, rows: torch.Tensor) -> None:
    """Float32: equal up to summation order. Bfloat16: both round one float32 value, so they
    differ by at most one bfloat16 step (2^-8 relative)."""
    bound = 2e-6 if got.dtype == torch.float32 else 2.0**-7
    torch.testing.assert_close(got[rows].float(), expected[rows].float(), atol=bound, rtol=bound)


DECODES = [(1, 1), (15, 1), (16, 1), (17, 1), (100, 1), (333, 1)]


@needs_kernel
@each_isa
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("block_size", "group", "head_dim", "kv_heads"),
    [
        (16, 3, 64, 3),
        (1, 1, 32, 1),
        (5, 8, 128, 2),
        (32, 16, 256, 1),
        (8, 4, 80, 4),
        (16, 1, 96, 8),
    ],
)
def test_decodes_match_the_oracle(
    isa: str, dtype: torch.dtype, block_size: int, group: int, head_dim: int, kv_heads: int
) -> None:
    case = make_case(
        DECODES,
        block_size=block_size,
        head_dim=head_dim,
        group=group,
        dtype=dtype,
        num_kv_heads=kv_heads,
        seed=block_size + group,
    )
    got = _native(case, isa=isa)
    _assert_matches(got, _oracle(case), torch.arange(len(DECODES)))
    assert not got.isnan().any()


@needs_kernel
@each_isa
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 7, 16, 40, 1000])
def test_sliding_window_matches_the_oracle(isa: str, dtype: torch.dtype, window: int) -> None:
    case = make_case(DECODES, block_size=16, head_dim=64, group=3, dtype=dtype, num_kv_heads=3)
    _assert_matches(
        _native(case, window, isa=isa), _oracle(case, window), torch.arange(len(DECODES))
    )


@needs_kernel
@each_isa
@pytest.mark.parametrize("seqs", [1, 2, 5, 16])
def test_long_contexts_use_the_team_and_match(isa: str, seqs: int) -> None:
    """Above the kernel's serial threshold: items split by KV head (few sequences) or by
    sequence (many), on two threads."""
    lengths = [(700 + 37 * seq, 1) for seq in range(seqs)]
    case = make_case(
        lengths, block_size=16, head_dim=64, group=3, dtype=torch.bfloat16, num_kv_heads=3
    )
    _assert_matches(_native(case, isa=isa), _oracle(case), torch.arange(seqs))


@needs_kernel
@each_isa
def test_result_does_not_depend_on_threads_or_physical_blocks(isa: str) -> None:
    """One item is computed by one thread in key order, so 1 and 2 threads give the same bits;
    the keys are read in block-table order, so moving the blocks changes nothing."""
    lengths = [(500 + 50 * seq, 1) for seq in range(6)]
    case = make_case(
        lengths, block_size=16, head_dim=64, group=3, dtype=torch.bfloat16, num_kv_heads=3
    )
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _native(case, isa=isa)
        torch.set_num_threads(2)
        two = _native(case, isa=isa)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    moved = torch.randperm(case.k_cache.shape[0], generator=torch.Generator().manual_seed(3))
    inverse = torch.argsort(moved)  # block b now lives at inverse[b]
    tables = case.block_tables.long()
    relocated = AttentionCase(
        query=case.query,
        k_cache=case.k_cache[moved].contiguous(),
        v_cache=case.v_cache[moved].contiguous(),
        cu_query_lens=case.cu_query_lens,
        context_lens=case.context_lens,
        block_tables=torch.where(tables >= 0, inverse[tables.clamp(min=0)], tables).int(),
        scale=case.scale,
    )
    assert torch.equal(_native(relocated, isa=isa), one)


@needs_kernel
@each_isa
def test_writes_only_decode_rows_of_strided_operands(isa: str) -> None:
    """Query and output as slices of wider tensors (a fused QKV projection): only the decodes'
    rows of `out` change, the prefill rows and the columns beside it keep their values."""
    lengths = [(40, 9), (33, 1), (16, 0), (70, 1)]
    case = make_case(lengths, block_size=8, head_dim=64, group=2, dtype=torch.float32)
    tokens, heads, dim = case.query.shape
    fused = torch.randn(tokens, heads + 3, dim)
    fused[:, :heads] = case.query
    wide_out = torch.full((tokens, heads + 2, dim), 7.0)
    out = wide_out[:, 1 : heads + 1]
    attention_cpu.decode_attention(
        fused[:, :heads],
        case.k_cache,
        case.v_cache,
        _decode_rows(case),
        case.scale,
        None,
        out,
        isa=isa,
    )
    decode_rows = torch.tensor([9, 10])
    _assert_matches(out, _oracle(case), decode_rows)
    assert (out[:9] == 7.0).all() and (wide_out[:, 0] == 7).all() and (wide_out[:, -1] == 7).all()


def test_query_rows_are_each_row_as_the_decode_of_its_position() -> None:
    """`DecodeRows.of_queries`: every query row of the sequences with query tokens, in order;
    row j of a chunk of q tokens ending at context c sees c - q + 1 + j keys, with its
    sequence's block table (a plain loop over the metadata is the oracle)."""
    lengths = [(41, 41), (33, 1), (16, 0), (70, 1), (65, 5), (3, 1)]
    case = make_case(lengths, block_size=16, head_dim=64, group=3, dtype=torch.bfloat16)
    queried = [seq for seq, (_, q_len) in enumerate(lengths) if q_len > 0]
    rows = DecodeRows.of_queries(queried, case.cu_query_lens, case.context_lens, case.block_tables)
    expected_rows, expected_lens, expected_tables = [], [], []
    for seq in queried:
        context_len, q_len = lengths[seq]
        start = int(case.cu_query_lens[seq])
        for j in range(q_len):
            expected_rows.append(start + j)
            expected_lens.append(context_len - q_len + 1 + j)
            expected_tables.append(case.block_tables[seq].tolist())
    assert rows.rows.dtype == torch.int64 and rows.rows.tolist() == expected_rows
    assert rows.context_lens.dtype == torch.int32 and rows.context_lens.tolist() == expected_lens
    assert rows.block_tables.dtype == torch.int32
    assert rows.block_tables.tolist() == expected_tables


PREFILLS = [(41, 41), (33, 1), (16, 0), (70, 1), (65, 5), (300, 17), (3, 1), (129, 128)]
"""Whole prompts, chunks after a cached prefix, decodes and an idle sequence in one step."""


@needs_kernel
@each_isa
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 1, 9, 40])
def test_prefill_chunks_as_query_rows_match_the_oracle(
    isa: str, dtype: torch.dtype, window: int | None
) -> None:
    """Every query row of a mixed step through the kernel, each as the decode of its own
    position: the causal mask (and the window) of the oracle, row for row."""
    case = make_case(PREFILLS, block_size=16, head_dim=64, group=3, dtype=dtype, num_kv_heads=3)
    queried = [seq for seq, (_, q_len) in enumerate(PREFILLS) if q_len > 0]
    rows = DecodeRows.of_queries(queried, case.cu_query_lens, case.context_lens, case.block_tables)
    out = torch.full_like(case.query, float("nan"))
    attention_cpu.decode_attention(
        case.query, case.k_cache, case.v_cache, rows, case.scale, window, out, isa
    )
    _assert_matches(out, _oracle(case, window), torch.arange(case.query.shape[0]))
    assert not out.isnan().any()


@needs_kernel
def test_public_path_runs_every_query_row_through_the_kernel() -> None:
    """pagedserve_kernels.paged_attention on the CPU: decodes and prefill chunks in one kernel
    call (prepared once as `query_rows`), every row as the oracle gives it."""
    lengths = [(41, 41), (33, 1), (16, 0), (70, 1), (65, 5), (3, 1)]
    case = make_case(lengths, block_size=16, head_dim=64, group=3, dtype=torch.bfloat16)
    prepared = prepare_attention(
        case.cu_query_lens,
        case.context_lens,
        case.block_tables,
        num_blocks=case.k_cache.shape[0],
        block_size=16,
    )
    assert prepared.decode_rows is not None
    assert prepared.decode_rows.rows.tolist() == [41, 42, 48]
    assert prepared.query_rows is not None
    assert prepared.query_rows.rows.tolist() == list(range(49))
    got = pagedserve_kernels.paged_attention(
        case.query, case.k_cache, case.v_cache, **case.kwargs()
    )
    torch.testing.assert_close(got.float(), _oracle(case).float(), atol=2.0**-7, rtol=2.0**-7)


def test_accepts_only_what_the_kernel_takes() -> None:
    case = make_case(DECODES, block_size=16, head_dim=64, group=3, dtype=torch.bfloat16)
    query, k_cache, v_cache = case.query, case.k_cache, case.v_cache
    assert attention_cpu.accepts(query, k_cache, v_cache, query) == attention_cpu.available()
    half = case.query.half()
    assert not attention_cpu.accepts(half, k_cache.half(), v_cache.half(), half)
    # mixed dtypes
    assert not attention_cpu.accepts(query.float(), k_cache, v_cache, query.float())
    odd = make_case(DECODES, block_size=16, head_dim=72, group=1, dtype=torch.float32)
    assert not attention_cpu.accepts(odd.query, odd.k_cache, odd.v_cache, odd.query)
    wide = make_case(DECODES, block_size=16, head_dim=32, group=17, dtype=torch.float32)
    assert not attention_cpu.accepts(wide.query, wide.k_cache, wide.v_cache, wide.query)
    strided = k_cache.transpose(1, 2)
    assert not attention_cpu.accepts(query, strided, v_cache, query)
    assert not attention_cpu.accepts(query, k_cache, v_cache.transpose(1, 2), query)
    if attention_cpu.available():
        with pytest.raises(ValueError, match="does not take"):
            attention_cpu.decode_attention(
                half, k_cache.half(), case.v_cache.half(), _decode_rows(case), 0.1, None, half
            )
