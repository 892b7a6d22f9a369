"""GGUF loading for each quantization type, against HF transformers' own GGUF loader.

A tiny random Llama is written as GGUF (Q/K permuted like llama.cpp, matrices quantized), then
both our workers and HF load that same file: greedy tokens identical and logits within 1e-4.
The second start reads the dequantized cache (keyed by the weights digest) instead of the GGUF.
A Q4_1 file's layers also keep their 4-bit codes (where the CPU kernel runs), and the decode steps
here (1 row, float32) multiply those: the same bound against HF holds.
"""

from __future__ import annotations

import pathlib

import gguf
import pytest
import torch
import transformers

from pagedserve_kernels import q4_cpu
from tests.hf_gguf import hf_model_from_gguf
from tests.tiny_model import SEED
from tests.workers.gguf_writer import write_llama_gguf
from tests.workers.paged_runner import greedy_generate, hf_greedy
from workers import WorkerConfig, WorkerGroup

Q = gguf.GGMLQuantizationType
CONFIG = transformers.LlamaConfig(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    initializer_range=0.1,
    tie_word_embeddings=False,
)


@pytest.mark.parametrize(
    "matrix_type", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16, Q.F32], ids=lambda t: t.name
)
def test_quantized_gguf_matches_hf_gguf_loader(
    matrix_type: gguf.GGMLQuantizationType, tmp_path: pathlib.Path
) -> None:
    torch.manual_seed(SEED)
    source = transformers.LlamaForCausalLM(CONFIG).eval()
    path = write_llama_gguf(source, tmp_path / "tiny.gguf", matrix_type)
    reference = hf_model_from_gguf(path)
    config = WorkerConfig(
        dtype="float32",
        model=str(path),
        backend="local",
        block_size=4,
        num_device_blocks=32,
        weights_cache_dir=str(tmp_path / "cache"),
    )
    cache_stamps = []
    for start in ("first start (dequantizes)", "second start (cache)"):
        group = WorkerGroup(config)
        cached = tmp_path / "cache" / group.model_info.weights_digest / "model.safetensors"
        cache_stamps.append(cached.stat().st_mtime_ns)
        try:
            assert group.model_info.quantization == f"gguf:{matrix_type.name}", start
            model = group._local.model
            copies = [m.matmul.q4 for m in model.modules() if hasattr(m, "matmul")]
            if matrix_type == Q.Q4_1:
                assert all((q4 is not None) == q4_cpu.available() for q4 in copies), start
            elif matrix_type in (Q.F16, Q.F32):
                assert all(q4 is None for q4 in copies), start
            prompt = [5, 9, 200, 17, 3, 44, 128]
            run = greedy_generate(group, [prompt], 6, seed=2)
            tokens, logits = hf_greedy(reference, prompt, 6)
            assert run.tokens[0] == tokens, start
            torch.testing.assert_close(run.logits[0], logits, atol=1e-4, rtol=0)
        finally:
            group.shutdown()
    assert cache_stamps[0] == cache_stamps[1]  # the second start reused the cache
