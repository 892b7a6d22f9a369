"""A Q4_K_M-like GGUF (Q4_K, Q5_K and Q6_K matrices) runs on the file's own codes with
`quantized_activations`, against HF transformers loading the same file.

The tiny random Llama's matrices are stored as llama.cpp's Q4_K_M mix stores them (Q4_K, with
Q6_K for attn_v, ffn_down and the output head), one layer's gate and up as Q5_K. Without the
mode our float32 workers match HF's GGUF loader within 1e-4 (the K-quants dequantized exactly);
with it every linear layer keeps panels of the file's codes (kept only when they dequantize to
the loaded weight bit for bit), fused layers that mix Q4_K and Q6_K rows in the 6-bit form, and
teacher-forced on HF's greedy path the int8 products keep the fast-mode rule
(`tests.workers.paged_runner.fast_mode_flips`).
"""

from __future__ import annotations

import pathlib

import gguf
import pytest
import torch
import transformers

from pagedserve_kernels import q4_cpu, quant_dot_cpu
from tests.hf_gguf import hf_model_from_gguf
from tests.tiny_model import SEED
from tests.workers.gguf_writer import write_llama_gguf
from tests.workers.paged_runner import fast_mode_flips, greedy_generate, hf_greedy, teacher_forced
from tests.workers.test_gguf_header import assert_same_as_gguf_reader
from workers import WorkerConfig, WorkerGroup
from workers.dense_matmul import DenseMatmul

Q = gguf.GGMLQuantizationType
CONFIG = transformers.LlamaConfig(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=256,
    initializer_range=0.1,
    tie_word_embeddings=False,
)
PROMPTS = [[5, 9, 200, 17, 3, 44, 128], [77, 1, 250, 31], [12, 12, 90, 4, 180, 66, 7, 8, 99]]
STEPS = 12
NEAR_TIE = 0.5
"""The fast-mode rule's bound on a top-2 margin move (so a flip is a decision HF took by less
than this): measured 0.23 on this model (logits up to 5.8, median margin 0.52)."""
TYPICAL_MOVE = 0.05
"""The median move may not exceed this (measured 0.005; float32 without the mode: 2e-6)."""


def q4_k_m(name: str) -> gguf.GGMLQuantizationType:
    """llama.cpp's Q4_K_M choice for this tiny model's tensors, with layer 1's gate and up as
    Q5_K (Q5_K_M's)."""
    if name.endswith(("attn_v.weight", "ffn_down.weight")) or name == "output.weight":
        return Q.Q6_K
    if name.startswith("blk.1.ffn_") and name.endswith(("gate.weight", "up.weight")):
        return Q.Q5_K
    return Q.Q4_K


@pytest.fixture(scope="module")
def k_quant_file(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    torch.manual_seed(SEED)
    directory = tmp_path_factory.mktemp("k_quants")
    source = transformers.LlamaForCausalLM(CONFIG).eval()
    return write_llama_gguf(source, directory / "tiny-q4_k_m.gguf", Q.Q4_K, q4_k_m)


@pytest.fixture(scope="module")
def hf_reference(k_quant_file: pathlib.Path) -> transformers.PreTrainedModel:
    return hf_model_from_gguf(k_quant_file)


def start(path: pathlib.Path, quantized_activations: bool) -> WorkerGroup:
    return WorkerGroup(
        WorkerConfig(
            model=str(path),
            dtype="float32",
            backend="local",
            block_size=4,
            num_device_blocks=64,
            weights_cache_dir=str(path.parent / "cache"),
            quantized_activations=quantized_activations,
        )
    )


def test_k_quant_file_matches_hf_gguf_loader_in_float32(
    k_quant_file: pathlib.Path, hf_reference: transformers.PreTrainedModel
) -> None:
    group = start(k_quant_file, quantized_activations=False)
    try:
        assert group.model_info.quantization == "gguf:Q4_K"
        for prompt in PROMPTS:
            run = greedy_generate(group, [prompt], 6, seed=2)
            tokens, logits = hf_greedy(hf_reference, prompt, 6)
            assert run.tokens[0] == tokens
            torch.testing.assert_close(run.logits[0], logits, atol=1e-4, rtol=0)
    finally:
        group.shutdown()


@pytest.mark.skipif(not quant_dot_cpu.available(), reason="the int8 kernel needs AVX2 and FMA")
def test_k_quant_layers_run_on_the_files_codes_within_the_fast_mode_rule(
    k_quant_file: pathlib.Path, hf_reference: transformers.PreTrainedModel
) -> None:
    group = start(k_quant_file, quantized_activations=True)
    try:
        model = group._local.model
        widths = {
            name: module.matmul.panels.bits if module.matmul.panels is not None else None
            for name, module in model.named_modules()
            if isinstance(getattr(module, "matmul", None), DenseMatmul)
        }
        layer_widths = {name: bits for name, bits in widths.items() if name.startswith("layers.")}
        assert layer_widths, widths
        for name, bits in layer_widths.items():
            expected = 4  # Q4_K: attention output, layer 0's gate and up
            if name.endswith(("qkv_proj", "down_proj")):
                expected = 6  # Q6_K rows (with Q4_K ones in the fused qkv)
            elif name.startswith("layers.1.") and "gate_up" in name:
                expected = 5
            assert bits == expected, (name, bits)
        references = [hf_greedy(hf_reference, prompt, STEPS) for prompt in PROMPTS]
        ours = teacher_forced(group, PROMPTS, [tokens for tokens, _ in references])
    finally:
        group.shutdown()
    flips = fast_mode_flips(references, ours, NEAR_TIE, TYPICAL_MOVE)
    assert len(flips) <= len(PROMPTS) * STEPS // 10, flips


@pytest.mark.skipif(not q4_cpu.available(), reason="the 4-bit kernel needs AVX2 and FMA")
def test_q4_k_layers_keep_the_files_codes_as_the_4_bit_copy(
    k_quant_file: pathlib.Path, hf_reference: transformers.PreTrainedModel
) -> None:
    """Without `quantized_activations`, a layer stored as Q4_K alone decodes on the 4-bit
    kernel over the file's codes: its copy dequantizes to gguf's own dequantization bit for
    bit, and the decode steps (the kernel's rows) keep HF's greedy tokens and logits."""
    reader = gguf.GGUFReader(str(k_quant_file))
    stored = {tensor.name: tensor for tensor in reader.tensors}
    group = start(k_quant_file, quantized_activations=False)
    try:
        model = group._local.model
        copies = {
            name: module.matmul.q4
            for name, module in model.named_modules()
            if isinstance(getattr(module, "matmul", None), DenseMatmul)
            and name.startswith("layers.")
        }
        kept = {name for name, q4 in copies.items() if q4 is not None}
        # Q4_K alone: every o_proj and layer 0's gate/up; Q6_K or Q5_K rows keep no copy
        assert kept == {"layers.0.self_attn.o_proj", "layers.1.self_attn.o_proj",
                        "layers.0.mlp.gate_up_proj"}, kept  # fmt: skip
        for layer in (0, 1):
            tensor = stored[f"blk.{layer}.attn_output.weight"]
            oracle = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            copy = copies[f"layers.{layer}.self_attn.o_proj"].dequantize()
            assert torch.equal(copy, torch.from_numpy(oracle.astype("float32")))
        for prompt in PROMPTS:
            run = greedy_generate(group, [prompt], 6, seed=2)
            tokens, logits = hf_greedy(hf_reference, prompt, 6)
            assert run.tokens[0] == tokens
            torch.testing.assert_close(run.logits[0], logits, atol=1e-4, rtol=0)
    finally:
        group.shutdown()


def test_the_header_reader_gives_the_k_quant_files_tensors_as_gguf_reader_does(
    k_quant_file: pathlib.Path,
) -> None:
    """Model loading reads tensors through `read_gguf_header`: Q4_K / Q6_K blocks (and the
    float norms) come out as the `gguf` package's reader gives them."""
    assert_same_as_gguf_reader(k_quant_file)
