"""The oracle itself against independent dense computations on contiguous data."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve_kernels import reference
from pagedserve_kernels.kv_pool import allocate_kv_pool
from tests.kernels.cases import make_case


def _dense_keys(cache: torch.Tensor, table_row: torch.Tensor, context_len: int) -> torch.Tensor:
    """[context_len, H_kv, D] read with one reshape per block (not the oracle's per-token loop)."""
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    blocks = [cache[int(b)] for b in table_row[:num_blocks]]
    return torch.cat(blocks)[:context_len]


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("window", [None, 5])
def test_reference_attention_matches_masked_sdpa(group: int, window: int | None) -> None:
    lengths = [(19, 19), (16, 1), (17, 4)]
    case = make_case(lengths, block_size=8, head_dim=64, group=group, dtype=torch.float32)
    got = reference.paged_attention(
        case.query, case.k_cache, case.v_cache, sliding_window=window, **case.kwargs()
    )
    for seq, (context_len, q_len) in enumerate(lengths):
        start = int(case.cu_query_lens[seq])
        keys = _dense_keys(case.k_cache, case.block_tables[seq], context_len)
        values = _dense_keys(case.v_cache, case.block_tables[seq], context_len)
        keys = keys.transpose(0, 1).repeat_interleave(group, 0)  # [H_q, ctx, D]
        values = values.transpose(0, 1).repeat_interleave(group, 0)
        positions = torch.arange(context_len - q_len, context_len).unsqueeze(1)
        key_pos = torch.arange(context_len).unsqueeze(0)
        mask = key_pos <= positions
        if window is not None:
            mask &= key_pos > positions - window
        q = case.query[start : start + q_len].transpose(0, 1)
        expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=case.scale)
        torch.testing.assert_close(got[start : start + q_len], expected.transpose(0, 1))


def test_reference_full_prefill_matches_is_causal_sdpa() -> None:
    case = make_case([(24, 24)], block_size=8, head_dim=64, group=2, dtype=torch.float32)
    got = reference.paged_attention(case.query, case.k_cache, case.v_cache, **case.kwargs())
    keys = _dense_keys(case.k_cache, case.block_tables[0], 24).transpose(0, 1)
    values = _dense_keys(case.v_cache, case.block_tables[0], 24).transpose(0, 1)
    expected = F.scaled_dot_product_attention(
        case.query.transpose(0, 1),
        keys.repeat_interleave(2, 0),
        values.repeat_interleave(2, 0),
        is_causal=True,
        scale=case.scale,
    )
    torch.testing.assert_close(got, expected.transpose(0, 1))


def test_reference_write_then_read_round_trips() -> None:
    pool = allocate_kv_pool(
        num_layers=1, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=64,
        dtype=torch.float32, device="cpu",
    )  # fmt: skip
    key, value = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    reference.write_kv(key, value, pool[0, 0], pool[0, 1], torch.tensor([13, -1, 2]))
    assert torch.equal(pool[0, 0, 3, 1], key[0])
    assert torch.equal(pool[0, 1, 0, 2], value[2])
    assert int((pool != 0).any(dim=(-1, -2)).sum()) == 4  # two slots, K and V each


def test_reference_copy_and_swap_move_whole_blocks() -> None:
    pool = torch.randn(2, 2, 5, 4, 1, 64)
    before = pool.clone()
    reference.copy_blocks(pool, torch.tensor([[1, 3], [4, 0]]))
    assert torch.equal(pool[:, :, 3], before[:, :, 1])
    assert torch.equal(pool[:, :, 0], before[:, :, 4])
    assert torch.equal(pool[:, :, [1, 2, 4]], before[:, :, [1, 2, 4]])
    other = torch.zeros(2, 2, 3, 4, 1, 64)
    reference.swap_blocks(pool, other, torch.tensor([[2, 1]]))
    assert torch.equal(other[:, :, 1], pool[:, :, 2])
    assert not other[:, :, [0, 2]].any()
