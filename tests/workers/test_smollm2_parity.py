"""SmolLM2-135M-Instruct from its Q4_1 GGUF: our paged model against HF transformers.

Both sides load the same GGUF (HF dequantizes it with its own loader, so our dequantization and
Q/K un-permutation are checked too). Four chat prompts are prefilled in one batch, then decoded
together for 24 greedy tokens (more than a 16-token block) through block tables scattered over
the pool; the tokens must equal `generate(do_sample=False)` (the session's HF references of
`SMOLLM2_CHATS`, whose first four these are) and every step's logits must lie within 2e-3
(float32, 30 layers; observed differences are about 1e-4).

The prefill runs on the packed float32 weights, the decode steps (4 rows) on the 4-bit copy of
the Q4_1 weights wherever the CPU kernel runs (`workers.dense_matmul`): both paths are held to HF.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pagedserve_kernels import q4_cpu
from tests.workers.conftest import SMOLLM2_NEW_TOKENS, ChatReferences
from tests.workers.paged_runner import greedy_generate
from workers import WorkerConfig, WorkerGroup, load_tokenizer

pytestmark = pytest.mark.smollm2

NEW_TOKENS = SMOLLM2_NEW_TOKENS
LOGITS_ATOL = 2e-3
CHATS = 4
"""The leading `SMOLLM2_CHATS` this test runs."""


@pytest.fixture(scope="module")
def smollm2_group() -> Iterator[WorkerGroup]:
    group = WorkerGroup(
        WorkerConfig(
            dtype="float32", model="default", backend="local", block_size=16, num_device_blocks=64
        )
    )
    yield group
    group.shutdown()


def test_chat_prompts_match_hf_generate(
    smollm2_group: WorkerGroup,
    smollm2_chat_references: ChatReferences,
) -> None:
    matmuls = [m.matmul for m in smollm2_group._local.model.modules() if hasattr(m, "matmul")]
    assert matmuls and all((m.q4 is not None) == q4_cpu.available() for m in matmuls)
    tokenizer = load_tokenizer("default")
    prompts = smollm2_chat_references.prompts[:CHATS]
    references = smollm2_chat_references.references[:CHATS]
    run = greedy_generate(smollm2_group, prompts, NEW_TOKENS, seed=11)
    for tokens, logits, (reference_tokens, reference_logits) in zip(
        run.tokens, run.logits, references, strict=True
    ):
        assert tokens == reference_tokens, tokenizer.decode(tokens)
        torch.testing.assert_close(logits, reference_logits, atol=LOGITS_ATOL, rtol=0)
    assert "Paris" in tokenizer.decode(run.tokens[0])


def test_model_info_of_the_default_model(smollm2_group: WorkerGroup) -> None:
    info = smollm2_group.model_info
    assert info.architecture == "llama" and info.quantization == "gguf:Q4_1"
    assert (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim) == (30, 9, 3, 64)
    assert info.eos_token_ids == (2,) and info.max_model_len == 8192
    assert info.kv_bytes_per_block == 30 * 2 * 16 * 3 * 64 * 4
