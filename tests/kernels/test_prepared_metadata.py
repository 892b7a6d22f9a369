"""The prepared-metadata path (validated once per step, reused per layer) against the oracle."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import pagedserve_kernels
from pagedserve_kernels import reference
from tests.kernels.cases import (
    BLOCK_SIZES,
    KINDS,
    AttentionCase,
    assert_close,
    covering_grid,
    grid_id,
    lengths_for,
    make_case,
)


def _prepare(case: AttentionCase, **options: object) -> pagedserve_kernels.PreparedAttention:
    return pagedserve_kernels.prepare_attention(
        case.cu_query_lens,
        case.context_lens,
        case.block_tables,
        num_blocks=case.k_cache.shape[0],
        block_size=case.k_cache.shape[1],
        **options,  # type: ignore[arg-type]
    )


def _expected(case: AttentionCase, window: int | None = None) -> torch.Tensor:
    return reference.paged_attention(
        case.query, case.k_cache, case.v_cache, sliding_window=window, **case.kwargs()
    )


@pytest.mark.parametrize("params", covering_grid(), ids=grid_id)
def test_prepared_attention_matches_reference_in_every_layer(
    params: tuple[int, str, int, int, torch.dtype],
) -> None:
    """One preparation serves two layers (two caches of one geometry, different data)."""
    block_size, kind, group, head_dim, dtype = params
    lengths = lengths_for(kind, block_size)
    first = make_case(lengths, block_size=block_size, head_dim=head_dim, group=group, dtype=dtype)
    generator = torch.Generator().manual_seed(1)
    second = replace(
        first,
        query=torch.randn(first.query.shape, generator=generator).to(dtype),
        k_cache=torch.randn(first.k_cache.shape, generator=generator).to(dtype),
        v_cache=torch.randn(first.v_cache.shape, generator=generator).to(dtype),
    )
    layers = [first, second]
    metadata = _prepare(layers[0])
    for case in layers:
        got = pagedserve_kernels.paged_attention(
            case.query, case.k_cache, case.v_cache, scale=case.scale, metadata=metadata
        )
        assert_close(got, _expected(case), dtype)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_prepared_attention_with_small_decode_groups_and_window(block_size: int, kind: str) -> None:
    """Decodes split over many groups (one block's worth of keys each), with and without window."""
    lengths = [*lengths_for(kind, block_size), (5 * block_size - 3, 1), (2, 1)]
    case = make_case(lengths, block_size=block_size, head_dim=64, group=3, dtype=torch.float32)
    metadata = _prepare(case, decode_group_tokens=block_size)
    assert len(metadata.decode_groups) == sum(1 for _, q in lengths if q == 1)
    for window in (None, block_size // 2 + 3):
        got = pagedserve_kernels.paged_attention(
            case.query,
            case.k_cache,
            case.v_cache,
            scale=case.scale,
            sliding_window=window,
            metadata=metadata,
        )
        assert_close(got, _expected(case, window), torch.float32)


def test_prepared_decodes_of_equal_length_share_one_group_and_write_into_out() -> None:
    lengths = [(17, 1)] * 6 + [(9, 1)] * 3
    case = make_case(lengths, block_size=8, head_dim=64, group=2, dtype=torch.bfloat16, seed=3)
    metadata = _prepare(case)
    assert len(metadata.decode_groups) == 1
    out = torch.full_like(case.query, float("nan"))
    returned = pagedserve_kernels.paged_attention(
        case.query, case.k_cache, case.v_cache, scale=case.scale, out=out, metadata=metadata
    )
    assert returned is out
    assert_close(out, _expected(case), torch.bfloat16)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_prepared_write_kv_matches_reference_and_touches_only_its_slots(block_size: int) -> None:
    generator = torch.Generator().manual_seed(block_size)
    pool = torch.randn(2, 2, 6, block_size, 2, 64, generator=generator)
    expected = pool.clone()
    slots = torch.tensor([3, -1, 2 * block_size + 1, 6 * block_size - 1, -1, block_size])
    key = torch.randn(6, 2, 64, generator=generator)
    value = torch.randn(6, 2, 64, generator=generator)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    metadata = pagedserve_kernels.prepare_attention(
        cu,
        torch.tensor([6], dtype=torch.int32),
        torch.tensor([[0, 1, 2, 3, 4, 5]]),
        num_blocks=6,
        block_size=block_size,
        slot_mapping=slots,
    )
    for layer in range(2):
        pagedserve_kernels.write_kv(key, value, pool[layer, 0], pool[layer, 1], metadata=metadata)
        reference.write_kv(key, value, expected[layer, 0], expected[layer, 1], slots)
    assert torch.equal(pool, expected)


def _bad_tables(case: AttentionCase, value: int) -> torch.Tensor:
    tables = case.block_tables.clone()
    tables[1, 0] = value
    return tables


PREPARE_ERRORS = {
    "block ids outside": lambda c: {"block_tables": _bad_tables(c, c.k_cache.shape[0])},
    "negative": lambda c: {"block_tables": _bad_tables(c, -1)},
    "exceeds block_tables capacity": lambda c: {"block_tables": c.block_tables[:, :2]},
    "entries for": lambda c: {"cu_query_lens": c.cu_query_lens[:-1]},
    "non-decreasing": lambda c: {"cu_query_lens": torch.tensor([0, 17, 10, 19, 23, 23])},
    "query tokens but context_len": lambda c: {"context_lens": torch.ones_like(c.context_lens)},
    "int32 or int64": lambda c: {"context_lens": c.context_lens.float()},
    "rows for": lambda c: {"block_tables": c.block_tables[:-1]},
    "slots outside": lambda c: {"slot_mapping": torch.full((23,), c.k_cache.shape[0] * 8)},
    "same slot": lambda c: {"slot_mapping": torch.zeros(23, dtype=torch.int64)},
    "slot_mapping has 3 entries": lambda c: {"slot_mapping": torch.tensor([0, 1, 2])},
    "num_blocks": lambda c: {"num_blocks": 0},
    "block_size": lambda c: {"block_size": True},
    "decode_group_tokens": lambda c: {"decode_group_tokens": -4},
}


@pytest.mark.parametrize("problem", sorted(PREPARE_ERRORS))
def test_prepare_attention_rejects_bad_metadata(problem: str) -> None:
    case = make_case(
        lengths_for("mixed", 8), block_size=8, head_dim=64, group=2, dtype=torch.float32
    )
    assert int(case.cu_query_lens[-1]) == 23
    arguments: dict[str, object] = {
        "cu_query_lens": case.cu_query_lens,
        "context_lens": case.context_lens,
        "block_tables": case.block_tables,
        "num_blocks": case.k_cache.shape[0],
        "block_size": 8,
        "slot_mapping": torch.arange(23),
    }
    arguments.update(PREPARE_ERRORS[problem](case))
    match = "outside" if problem == "negative" else problem
    with pytest.raises(ValueError, match=match):
        pagedserve_kernels.prepare_attention(**arguments)  # type: ignore[arg-type]


def test_prepared_calls_reject_a_layer_that_does_not_match() -> None:
    case = make_case(
        lengths_for("mixed", 8), block_size=8, head_dim=64, group=2, dtype=torch.float32
    )
    metadata = _prepare(case)
    with pytest.raises(ValueError, match="prepared for"):
        pagedserve_kernels.paged_attention(
            case.query[:-1], case.k_cache, case.v_cache, scale=case.scale, metadata=metadata
        )
    with pytest.raises(ValueError, match="prepared for"):
        pagedserve_kernels.paged_attention(
            case.query, case.k_cache[:-1], case.v_cache[:-1], scale=case.scale, metadata=metadata
        )
    with pytest.raises(ValueError, match="not both"):
        pagedserve_kernels.paged_attention(
            case.query, case.k_cache, case.v_cache, metadata=metadata, **case.kwargs()
        )  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="or metadata"):
        pagedserve_kernels.paged_attention(case.query, case.k_cache, case.v_cache, scale=case.scale)
    with pytest.raises(ValueError, match="slot_mapping"):
        pagedserve_kernels.write_kv(
            case.query[:, :2], case.query[:, :2], case.k_cache, case.v_cache, metadata=metadata
        )
    with pytest.raises(ValueError, match="exactly one"):
        pagedserve_kernels.write_kv(
            case.query[:, :2], case.query[:, :2], case.k_cache, case.v_cache
        )
