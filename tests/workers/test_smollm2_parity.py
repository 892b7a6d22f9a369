"""SmolLM2-135M-Instruct from its Q4_1 GGUF: our paged model against HF transformers.

Both sides load the same GGUF (HF dequantizes it with its own loader, so our dequantization and
Q/K un-permutation are checked too). Four chat prompts are prefilled in one batch, then decoded
together for 32 greedy tokens through block tables scattered over the pool; the tokens must equal
`generate(do_sample=False)` and every step's logits must lie within 2e-3 (float32, 30 layers;
observed differences are about 1e-4).

The prefill runs on the packed float32 weights, the decode steps (4 rows) on the 4-bit copy of
the Q4_1 weights wherever the CPU kernel runs (`workers.dense_matmul`): both paths are held to HF.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
import torch
import transformers

from pagedserve_kernels import q4_cpu
from tests.workers.paged_runner import chat_prompt_ids, greedy_generate, hf_greedy
from workers import WorkerConfig, WorkerGroup, load_tokenizer

pytestmark = pytest.mark.smollm2

NEW_TOKENS = 32
LOGITS_ATOL = 2e-3
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a hash table is in one sentence.",
]


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
    smollm2_hf: transformers.PreTrainedModel,
    tiny_model_dir: pathlib.Path,
) -> None:
    matmuls = [m.matmul for m in smollm2_group._local.model.modules() if hasattr(m, "matmul")]
    assert matmuls and all((m.q4 is not None) == q4_cpu.available() for m in matmuls)
    # The tiny model directory holds SmolLM2's tokenizer as built by load_tokenizer("default").
    tokenizer = load_tokenizer(str(tiny_model_dir))
    prompts = chat_prompt_ids(tokenizer, CHATS)
    run = greedy_generate(smollm2_group, prompts, NEW_TOKENS, seed=11)
    for prompt, tokens, logits in zip(prompts, run.tokens, run.logits, strict=True):
        reference_tokens, reference_logits = hf_greedy(smollm2_hf, prompt, NEW_TOKENS)
        assert tokens == reference_tokens, tokenizer.decode(tokens)
        torch.testing.assert_close(logits, reference_logits, atol=LOGITS_ATOL, rtol=0)
    assert "Paris" in tokenizer.decode(run.tokens[0])


def test_model_info_of_the_default_model(smollm2_group: WorkerGroup) -> None:
    info = smollm2_group.model_info
    assert info.architecture == "llama" and info.quantization == "gguf:Q4_1"
    assert (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim) == (30, 9, 3, 64)
    assert info.eos_token_ids == (2,) and info.max_model_len == 8192
    assert info.kv_bytes_per_block == 30 * 2 * 16 * 3 * 64 * 4
