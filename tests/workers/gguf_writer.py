"""Write an HF Llama's weights as a GGUF file the way llama.cpp's converter does (for tests).

Q and K rows are permuted into llama.cpp's interleaved rotary order and matrices are quantized
with the `gguf` package, so loading the file exercises dequantization and the un-permutation.
"""

from __future__ import annotations

import pathlib

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


def write_llama_gguf(
    model: transformers.LlamaForCausalLM, path: pathlib.Path, matrix_type: gguf.GGMLQuantizationType
) -> pathlib.Path:
    """`model` as a llama GGUF with every 2-D weight stored as `matrix_type`, norms in F32."""
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
    for hf, ours in names.items():
        values = state[hf].to(torch.float32).numpy()
        if ours.endswith("attn_q.weight"):
            values = llama_cpp_permute(values, config.num_attention_heads)
        elif ours.endswith("attn_k.weight"):
            values = llama_cpp_permute(values, config.num_key_value_heads)
        kind = matrix_type if values.ndim == 2 else gguf.GGMLQuantizationType.F32
        writer.add_tensor(ours, gguf.quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
