"""Write an HF Llama's weights as a GGUF file the way llama.cpp's converter does (for tests).

Q and K rows are permuted into llama.cpp's interleaved rotary order and matrices are quantized
with the `gguf` package, so loading the file exercises dequantization and the un-permutation.
The gguf package cannot quantize K-quants: a matrix stored as one gets random blocks of that
type instead of the model's values (scales small enough for a sane model), so such a file is
a different random model, which both HF and we read from the file.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import gguf
import numpy as np
import torch
import transformers

LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """HF rotate-half rows -> llama.cpp interleaved rows, per head."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


K_QUANTS = (
    gguf.GGMLQuantizationType.Q4_K,
    gguf.GGMLQuantizationType.Q5_K,
    gguf.GGMLQuantizationType.Q6_K,
)


def random_k_blocks(
    kind: gguf.GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator
) -> np.ndarray:
    """Random `kind` blocks `[rows, bytes]` of a `[rows, cols]` matrix: every code, scale and
    minimum pattern, with float16 super-block scales that keep weights below about 0.5."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    if kind == gguf.GGMLQuantizationType.Q6_K:  # d after the scales: |w| <= d * 128 * 32
        d = rng.uniform(2e-5, 1e-4, (raw.shape[0], 1)).astype(np.float16)
        raw[:, -2:] = d.view(np.uint8)
    else:  # d and dmin first: |w| <= 63 * (d * 31 + dmin)
        halves = rng.uniform(1e-4, 2.5e-4, (raw.shape[0], 2)).astype(np.float16)
        raw[:, :4] = halves.view(np.uint8).reshape(-1, 4)
    return raw.reshape(rows, -1)


def write_llama_gguf(
    model: transformers.LlamaForCausalLM,
    path: pathlib.Path,
    matrix_type: gguf.GGMLQuantizationType,
    kind_of: Callable[[str], gguf.GGMLQuantizationType] | None = None,
) -> pathlib.Path:
    """`model` as a llama GGUF with every 2-D weight stored as `matrix_type` (or as
    `kind_of(gguf tensor name)`: a mix such as Q4_K_M), norms in F32."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }
    if not config.tie_word_embeddings:
        names["lm_head.weight"] = "output.weight"
    for index in range(config.num_hidden_layers):
        for hf, ours in LAYER_NAMES.items():
            names[f"model.layers.{index}.{hf}"] = f"blk.{index}.{ours}"
    state = model.state_dict()
    rng = np.random.default_rng(0)
    for hf, ours in names.items():
        values = state[hf].to(torch.float32).numpy()
        if ours.endswith("attn_q.weight"):
            values = llama_cpp_permute(values, config.num_attention_heads)
        elif ours.endswith("attn_k.weight"):
            values = llama_cpp_permute(values, config.num_key_value_heads)
        kind = gguf.GGMLQuantizationType.F32
        if values.ndim == 2:
            kind = matrix_type if kind_of is None else kind_of(ours)
        if kind in K_QUANTS:
            blocks = random_k_blocks(kind, *values.shape, rng)
        else:
            blocks = gguf.quants.quantize(values, kind)
        writer.add_tensor(ours, blocks, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_iq4_nl_gguf(path: pathlib.Path) -> pathlib.Path:
    """A one-layer qwen3 GGUF whose embedding is IQ4_NL, a tensor type the loader cannot read."""
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_embedding_length(32)
    writer.add_block_count(1)
    writer.add_head_count(1)
    writer.add_feed_forward_length(32)
    iq4_nl = np.zeros((64, 18), dtype=np.uint8)  # 64 rows of one 32-value IQ4_NL block
    writer.add_tensor("token_embd.weight", iq4_nl, raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
