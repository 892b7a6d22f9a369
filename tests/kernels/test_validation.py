"""Bad input raises ValueError naming the problem, before anything is written or launched."""

from __future__ import annotations

import pytest
import torch

import pagedserve_kernels
from tests.kernels.cases import AttentionCase, lengths_for, make_case


def _case() -> AttentionCase:
    return make_case(
        lengths_for("mixed", 8), block_size=8, head_dim=64, group=2, dtype=torch.float32
    )


def _attend(case: AttentionCase, **overrides: object) -> None:
    arguments: dict[str, object] = {
        "query": case.query,
        "k_cache": case.k_cache,
        "v_cache": case.v_cache,
        **case.kwargs(),
    }
    arguments.update(overrides)
    pagedserve_kernels.paged_attention(**arguments)  # type: ignore[arg-type]


def _table_with(case: AttentionCase, value: int) -> torch.Tensor:
    tables = case.block_tables.clone()
    tables[0, 0] = value
    return tables


ATTENTION_ERRORS = {
    "3 dimensions": lambda c: {"query": c.query[0]},
    "head_dim 48 unsupported": lambda c: {
        "k_cache": c.k_cache[..., :48],
        "v_cache": c.v_cache[..., :48],
        "query": c.query[..., :48],
    },
    "not a multiple": lambda c: {"query": c.query[:, :3]},
    "dtype": lambda c: {"query": c.query.half()},
    "unsupported dtype": lambda c: {"query": c.query.double()},
    "differ in shape": lambda c: {"v_cache": c.v_cache[:-1]},
    "entries for": lambda c: {"cu_query_lens": c.cu_query_lens[:-1]},
    "start at 0": lambda c: {"cu_query_lens": c.cu_query_lens + 1},
    "query tokens but context_len": lambda c: {"context_lens": torch.ones_like(c.context_lens)},
    "exceeds block_tables capacity": lambda c: {"block_tables": c.block_tables[:, :2]},
    "block ids outside": lambda c: {"block_tables": _table_with(c, c.k_cache.shape[0])},
    "negative block": lambda c: {"block_tables": _table_with(c, -1)},
    "int32 or int64": lambda c: {"context_lens": c.context_lens.float()},
    "sliding_window": lambda c: {"sliding_window": 0},
    "scale": lambda c: {"scale": float("nan")},
    "out must": lambda c: {"out": torch.empty(1, 4, 64)},
}


@pytest.mark.parametrize("problem", sorted(ATTENTION_ERRORS))
def test_paged_attention_rejects(problem: str) -> None:
    case = _case()
    overrides = ATTENTION_ERRORS[problem](case)
    expected = "outside" if problem == "negative block" else problem
    with pytest.raises(ValueError, match=expected):
        _attend(case, **overrides)


def test_attention_rejects_a_decreasing_cumulative_length() -> None:
    case = _case()
    cu = case.cu_query_lens.clone()
    cu[3] = cu[2] - 1  # sequence 2 would have -1 query tokens
    with pytest.raises(ValueError, match="non-decreasing"):
        _attend(case, cu_query_lens=cu)


def _pool() -> torch.Tensor:
    return torch.randn(2, 2, 4, 8, 2, 64)


WRITE_ERRORS = {
    "slots outside": {"slots": torch.tensor([0, 32, -1])},
    "below -1": {"slots": torch.tensor([0, -2, 1])},
    "same slot": {"slots": torch.tensor([5, 5, -1])},
    "entries for": {"slots": torch.tensor([0, 1])},
    "do not match": {"key": torch.randn(3, 1, 64), "value": torch.randn(3, 1, 64)},
    "differs from cache dtype": {"key": torch.randn(3, 2, 64).half()},
    "int32 or int64": {"slots": torch.tensor([0.0, 1.0, 2.0])},
}


@pytest.mark.parametrize("problem", sorted(WRITE_ERRORS))
def test_write_kv_rejects_without_writing(problem: str) -> None:
    pool = _pool()
    before = pool.clone()
    arguments = {
        "key": torch.randn(3, 2, 64),
        "value": torch.randn(3, 2, 64),
        "slots": torch.tensor([0, 1, 2]),
    }
    arguments.update(WRITE_ERRORS[problem])
    match = "slots outside" if problem == "below -1" else problem
    with pytest.raises(ValueError, match=match):
        pagedserve_kernels.write_kv(
            arguments["key"], arguments["value"], pool[0, 0], pool[0, 1], arguments["slots"]
        )
    assert torch.equal(pool, before)


def test_write_kv_rejects_a_non_contiguous_cache() -> None:
    pool = _pool()
    with pytest.raises(ValueError, match="contiguous"):
        pagedserve_kernels.write_kv(
            torch.randn(1, 2, 64),
            torch.randn(1, 2, 64),
            pool[0, 0, :, ::2],
            pool[0, 1, :, ::2],
            torch.tensor([0]),
        )


@pytest.mark.parametrize(
    ("pairs", "match"),
    [
        (torch.tensor([[0, 4]]), "destination block ids outside"),
        (torch.tensor([[-1, 2]]), "source block ids outside"),
        (torch.tensor([[0, 2], [1, 2]]), "more than once"),
        (torch.tensor([[0, 1], [1, 2]]), "also a source"),
        (torch.tensor([0, 1]), r"\[P, 2\]"),
        (torch.tensor([[0.0, 1.0]]), "int32 or int64"),
    ],
)
def test_copy_blocks_rejects_without_copying(pairs: torch.Tensor, match: str) -> None:
    pool = _pool()
    before = pool.clone()
    with pytest.raises(ValueError, match=match):
        pagedserve_kernels.copy_blocks(pool, pairs)
    assert torch.equal(pool, before)


@pytest.mark.parametrize(
    ("dst_pool", "pairs", "match"),
    [
        (torch.randn(2, 2, 3, 8, 2, 64), torch.tensor([[4, 0]]), "source block ids outside"),
        (torch.randn(2, 2, 3, 8, 2, 64), torch.tensor([[0, 3]]), "destination block ids outside"),
        (torch.randn(2, 2, 3, 8, 1, 64), torch.tensor([[0, 0]]), "beyond the block count"),
        (torch.randn(2, 2, 3, 8, 2, 64).half(), torch.tensor([[0, 0]]), "dtype"),
        (torch.randn(2, 3, 8, 2, 64), torch.tensor([[0, 0]]), "num_layers, 2"),
    ],
)
def test_swap_blocks_rejects_without_copying(
    dst_pool: torch.Tensor, pairs: torch.Tensor, match: str
) -> None:
    src_pool = _pool()
    before = dst_pool.clone()
    with pytest.raises(ValueError, match=match):
        pagedserve_kernels.swap_blocks(src_pool, dst_pool, pairs)
    assert torch.equal(dst_pool, before)


def test_swap_blocks_rejects_one_pool_as_both_ends() -> None:
    pool = _pool()
    with pytest.raises(ValueError, match="same tensor"):
        pagedserve_kernels.swap_blocks(pool, pool, torch.tensor([[0, 1]]))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"num_blocks": 0}, "num_blocks"),
        ({"head_dim": 48}, "head_dim"),
        ({"dtype": torch.int32}, "dtype"),
    ],
)
def test_allocate_kv_pool_rejects(overrides: dict[str, object], match: str) -> None:
    arguments: dict[str, object] = {
        "num_layers": 1,
        "num_blocks": 2,
        "block_size": 8,
        "num_kv_heads": 1,
        "head_dim": 64,
        "dtype": torch.float32,
        "device": "cpu",
    }
    arguments.update(overrides)
    with pytest.raises(ValueError, match=match):
        pagedserve_kernels.allocate_kv_pool(**arguments)  # type: ignore[arg-type]
