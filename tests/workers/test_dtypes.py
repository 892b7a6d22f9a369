"""Half-precision runs: the same model in float16 and bfloat16 stays close to float32.

Tolerance: logits within 2% of the float32 logits' range (observed: 0.08% float16, 0.8%
bfloat16), and the KV pools hold the requested dtype.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

from tests.workers.paged_runner import greedy_generate
from workers import WorkerConfig, WorkerGroup
from workers.dense_matmul import DenseMatmul, can_pack


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_logits_stay_close_to_float32(
    dtype: str, tiny_model_dir: pathlib.Path, weights_cache: pathlib.Path, tiny_group: WorkerGroup
) -> None:
    prompts = [[5, 17, 99, 1000, 48000, 3, 77, 12, 9]]
    reference = greedy_generate(tiny_group, prompts, 1, seed=4).logits[0]
    group = WorkerGroup(
        WorkerConfig(
            model=str(tiny_model_dir),
            backend="local",
            dtype=dtype,
            block_size=4,
            num_device_blocks=16,
            weights_cache_dir=str(weights_cache),
        )
    )
    try:
        assert group.model_info.dtype == dtype
        assert group.model_info.kv_bytes_per_block == tiny_group.model_info.kv_bytes_per_block // 2
        logits = greedy_generate(group, prompts, 1, seed=4).logits[0]
        spread = float(reference.max() - reference.min())
        assert float((logits - reference).abs().max()) <= 0.02 * spread
        assert logits.dtype == torch.float32
        model = group._local.model
        matmuls = [
            m.matmul for m in model.modules() if isinstance(getattr(m, "matmul", None), DenseMatmul)
        ]
        assert len(matmuls) == 4 * len(model.layers)
        # bfloat16 layers are prepacked wherever oneDNN can (float16 ones never are)
        packable = dtype == "bfloat16" and can_pack(matmuls[0].weight)
        assert all((m.packed is not None) == packable for m in matmuls)
        assert model.lm_head.screen is not None  # the reduced modes' screened float32 head
    finally:
        group.shutdown()


def test_float32_model_packs_its_linears_and_lm_head(tiny_group: WorkerGroup) -> None:
    """The exact mode packs every linear and its (unscreened) LM head where oneDNN can."""
    model = tiny_group._local.model
    matmuls = [
        m.matmul for m in model.modules() if isinstance(getattr(m, "matmul", None), DenseMatmul)
    ]
    packable = can_pack(matmuls[0].weight)
    assert all((m.packed is not None) == packable for m in matmuls)
    assert model.lm_head.screen is None
    assert (model.lm_head.head_matmul.packed is not None) == packable
