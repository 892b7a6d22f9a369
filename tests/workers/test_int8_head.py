"""The int8-screened LM head (`workers.int8_head`) against the float32 head on the same weights.

Oracle: `F.linear` in float32 over the gguf package's dequantized Q8_0 weights, and the
kernel's own int8 estimate (`pagedserve_kernels.quant_dot_cpu`). Hidden rows are built with near
ties (two vocabulary rows nearly equal in direction) so the screen has work to do.
"""

from __future__ import annotations

import gguf
import pytest
import torch
import torch.nn.functional as F

from pagedserve_kernels import quant_dot_cpu
from pagedserve_kernels.q8_cpu import Q8Weight
from pagedserve_kernels.quant_dot_cpu import PanelWeight
from tests.kernels.gguf_blocks import gguf_blocks
from workers.int8_head import Int8ScreenedHead

pytestmark = pytest.mark.skipif(
    not quant_dot_cpu.available(), reason="the int8-activation kernel needs AVX2 and FMA"
)


@pytest.mark.parametrize("vocab", [640, 1000])  # whole chunks, and a partial last chunk
def test_greedy_choices_are_the_float32_heads_and_near_maxima_are_float32(vocab: int) -> None:
    _, weight = gguf_blocks(gguf.GGMLQuantizationType.Q8_0, vocab, 96, seed=vocab)
    q8 = Q8Weight.recover(weight)
    assert q8 is not None
    head = Int8ScreenedHead.of(weight, PanelWeight.from_q8(q8))
    generator = torch.Generator().manual_seed(vocab)
    hidden = torch.randn(24, 96, generator=generator)
    # rows 0-11: their two largest logits made equal (up to noise) by moving the row off
    # the difference of those two vocabulary rows
    for row in range(12):
        for _ in range(3):
            first, second = F.linear(hidden[row], weight).topk(2).indices
            apart = weight[first] - weight[second]
            hidden[row] -= (hidden[row] @ apart) / (apart @ apart) * apart
        hidden[row] += 1e-4 * torch.randn(96, generator=generator)
    got = head.logits(hidden)
    exact = F.linear(hidden, weight)
    assert got.shape == (24, vocab)
    assert torch.equal(got.argmax(1), exact.argmax(1))
    estimate = quant_dot_cpu.quant_matmul(hidden, head.panels)
    assert not torch.equal(estimate.argmax(1), exact.argmax(1))  # the screen was needed
    refined = got != estimate
    assert bool(refined.any())  # the screen recomputed something
    torch.testing.assert_close(got[refined], exact[refined], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[~refined], estimate[~refined])


def test_panels_of_another_shape_are_refused() -> None:
    _, weight = gguf_blocks(gguf.GGMLQuantizationType.Q8_0, 64, 64, seed=1)
    q8 = Q8Weight.recover(weight)
    assert q8 is not None
    with pytest.raises(ValueError, match="do not hold"):
        Int8ScreenedHead.of(weight[:32], PanelWeight.from_q8(q8))
