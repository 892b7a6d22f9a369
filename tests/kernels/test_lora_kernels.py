"""Batched multi-LoRA: the CPU path and the Triton kernels against the per-token oracle.

A batch mixes tokens of several slots and of the base model (slot -1); the adapters' ranks are
padded with zeros inside the slots like the worker's slot buffers pad them.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve_kernels import lora, triton_lora
from tests.kernels.cases import triton_device

WIDTHS = (48, 16, 16)  # a fused q/k/v target


def _case(slots: list[int], dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    num_slots, fused, rank, inputs = 4, len(WIDTHS), 8, 40
    a = torch.randn(num_slots, fused * rank, inputs, generator=generator)
    b = torch.zeros(num_slots, fused * rank, sum(WIDTHS))
    row = 0
    for p, width in enumerate(WIDTHS):  # block-diagonal, as the slots hold it
        block = torch.randn(num_slots, rank, width, generator=generator)
        b[:, p * rank : (p + 1) * rank, row : row + width] = block
        row += width
    for p in range(fused):  # slot 1 holds a rank-5 adapter
        a[1, p * rank + 5 : (p + 1) * rank] = 0
        b[1, p * rank + 5 : (p + 1) * rank] = 0
    a = a.transpose(1, 2).contiguous().transpose(1, 2)  # strided, as the workers' slots give it
    x = torch.randn(len(slots), inputs, generator=generator)
    y = torch.randn(len(slots), sum(WIDTHS), generator=generator)
    index = torch.tensor(slots, dtype=torch.int64)
    return (*(t.to(dtype) for t in (a, b, x, y)), index)


BATCHES = [
    [0, 0, 0],  # one adapter, every token
    [2, -1, 2, -1],  # one adapter and the base model
    [3, 0, -1, 1, 0, 3, 1],  # three adapters and the base model, interleaved
    [1, 2, 1, 2, 3],  # a run of slots: the batched products read the buffers as views
    [3, 1, 1, 3],  # equal groups: no padding row to drop
    [0] * 10 + [1, 3],  # groups too uneven to pad: one by one
    [-1, -1],  # no adapter: nothing to add
]


@pytest.mark.parametrize("slots", BATCHES)
@pytest.mark.parametrize("path", ["cpu", "triton"])
def test_add_lora_matches_the_oracle(slots: list[int], path: str) -> None:
    a, b, x, y, index = _case(slots, torch.float32)
    expected = y.clone()
    lora.reference_add_lora(expected, x, a, b, WIDTHS, index)
    indices = lora.prepare_indices(index)
    if indices is None:
        assert all(s < 0 for s in slots)
        return
    assert indices.padded == (slots != [0] * 10 + [1, 3])
    if path == "cpu":
        lora.add_lora(y, x, a, b, WIDTHS, indices)
    else:
        device = triton_device()
        y_dev = y.to(device)
        triton_lora.add_lora(y_dev, x.to(device), a.to(device), b.to(device), WIDTHS, indices, None)
        y = y_dev.cpu()
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-5)


def test_reduce_applies_to_the_intermediate() -> None:
    """Row-parallel: two ranks each hold half of A's input columns; summing their intermediates
    (the all-reduce) gives the single-rank result."""
    a, b, x, y, index = _case([0, 1, -1, 1], torch.float32, seed=3)
    expected = y.clone()
    lora.reference_add_lora(expected, x, a, b, WIDTHS, index)
    indices = lora.prepare_indices(index)
    assert indices is not None
    halves = [(0, 20), (20, 40)]
    partial: list[torch.Tensor] = []

    def capture(h: torch.Tensor) -> torch.Tensor:
        partial.append(h)
        return h

    for start, stop in halves:  # each rank's shrink alone
        lora.add_lora(y.clone(), x[:, start:stop], a[..., start:stop], b, WIDTHS, indices, capture)
    total = partial[0] + partial[1]
    lora.add_lora(y, x[:, :20], a[..., :20], b, WIDTHS, indices, lambda _: total)
    assert indices.padded
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-5)


def test_bfloat16_close_to_the_oracle() -> None:
    slots = [1, 0, -1, 3]
    a, b, x, y, index = _case(slots, torch.bfloat16, seed=5)
    expected = y.float().clone()
    lora.reference_add_lora(expected, x.float(), a.float(), b.float(), WIDTHS, index)
    indices = lora.prepare_indices(index)
    assert indices is not None
    lora.add_lora(y, x, a, b, WIDTHS, indices)
    torch.testing.assert_close(y.float(), expected, atol=0.5, rtol=0.03)
