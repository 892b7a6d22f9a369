"""GGUF round trips per family: a tiny HF model written as llama.cpp's converter writes it
(its tensor names, metadata keys and conventions, with the `gguf` package), loaded, and
compared with the HF model it came from.

Independent of our name tables: the llama.cpp names are spelled out here. Gemma's norms are
stored as `1 + w` and Phi-3's projections stay fused, as the converter does. Matrices in F32
(exact: greedy tokens and logits within 1e-4) and in Q8_0 (dequantized weights differ from
HF's: the oracle is then the HF model with every matrix replaced by its dequantized Q8_0
values). Tokens identical, logits within 1e-4.
"""

from __future__ import annotations

import math
import pathlib
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers

from tests.tiny_model import SEED
from tests.workers.family_parity import assert_greedy_matches_hf, family_group
from tests.workers.gguf_writer import llama_cpp_permute
from tests.workers.tiny_families import COMMON, FAMILY_MODELS
from workers.loader import read_spec

# The Ray tests here run Ray core actors only (no Serve): beside the Serve tests under xdist.
pytestmark = pytest.mark.plain_ray

LLAMA_CPP_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GEMMA_NAMES = {
    **LLAMA_CPP_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
PHI3_NAMES = {
    **LLAMA_CPP_NAMES,
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
}
GGUF_CASES: dict[str, dict[str, Any]] = {
    "qwen3": {},
    "mixtral": {"sliding_window": None},  # llama.cpp writes no window for Mixtral
    "qwen3_moe": {"norm_topk_prob": True},  # llama.cpp renormalizes
    "gemma2": {"query_pre_attn_scalar": 32},  # GGUF attends with head_dim ** -0.5
    "gemma3": {"query_pre_attn_scalar": 32},
    "phi3": {},  # LongRoPE with a partial rotary, as the parity test's
}
"""Family -> config entries replacing the parity tests'."""
GGUF_ARCHITECTURES = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}
"""`general.architecture` where it is not our family name: llama.cpp writes Mixtral as a
Llama with experts (`llama.expert_count`)."""
QK_PERMUTED = ("mixtral",)
"""Families whose Q/K rows llama.cpp's converter permutes into interleaved rotary order."""


def _model(name: str) -> transformers.PreTrainedModel:
    model_class, config_class, extra = FAMILY_MODELS[name]
    torch.manual_seed(SEED)
    config = config_class(**{**COMMON, **extra, **GGUF_CASES[name]})
    model = model_class(config).to(torch.float32).eval()
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if parameter_name.endswith("norm.weight"):
                parameter.add_(torch.randn_like(parameter) * 0.2)
    return model


def _as_stored(model: Any, matrix: str) -> Any:
    """`model` with every matrix (and expert stack) as the GGUF file stores it (quantized, then
    dequantized)."""
    kind = getattr(gguf.GGMLQuantizationType, matrix)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.ndim >= 2:
                stored = gguf.quants.quantize(parameter.numpy(), kind)
                restored = gguf.quants.dequantize(stored, kind).reshape(parameter.shape)
                parameter.copy_(torch.from_numpy(restored.astype("float32")))
    return model


EXPERT_STACKS = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
}


def _write(name: str, model: Any, path: pathlib.Path, matrix: gguf.GGMLQuantizationType) -> None:
    config = model.config
    writer = gguf.GGUFWriter(str(path), GGUF_ARCHITECTURES.get(name, name))
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if name == "qwen3_moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if name == "mixtral":  # the experts' width is feed_forward_length
        writer.add_expert_count(config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    rope = config.rope_parameters
    if name == "gemma3":
        writer.add_rope_freq_base(float(rope["full_attention"]["rope_theta"]))
        writer.add_rope_freq_base_swa(float(rope["sliding_attention"]["rope_theta"]))
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["full_attention"]["factor"]))
    else:
        writer.add_rope_freq_base(float(rope["rope_theta"]))
    if rope.get("rope_type") == "longrope":  # llama.cpp's Phi-3: factor tensors, attn factor
        original = config.original_max_position_embeddings
        writer.add_rope_scaling_orig_ctx_len(original)
        scale = config.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        for kind in ("short", "long"):
            values = np.array(rope[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", values)
    rotary = int(config.head_dim * rope.get("partial_rotary_factor", 1.0))
    writer.add_rope_dimension_count(rotary)
    if name.startswith("gemma"):
        writer.add_sliding_window(config.sliding_window)
        if config.attn_logit_softcapping is not None:
            writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        if config.final_logit_softcapping is not None:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
    names = (
        GEMMA_NAMES
        if name.startswith("gemma")
        else PHI3_NAMES
        if name == "phi3"
        else LLAMA_CPP_NAMES
    )
    tensors = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }
    if not config.tie_word_embeddings:
        tensors["lm_head.weight"] = "output.weight"
    state = model.state_dict()
    for index in range(config.num_hidden_layers):
        for hf, ours in names.items():
            if f"model.layers.{index}.{hf}" in state:
                tensors[f"model.layers.{index}.{hf}"] = f"blk.{index}.{ours}"
    arrays = {}
    if name in ("qwen3_moe", "mixtral"):  # the router, each projection of the experts as a stack
        for index in range(config.num_hidden_layers):
            prefix = f"model.layers.{index}.mlp."
            arrays[f"blk.{index}.ffn_gate_inp.weight"] = state[f"{prefix}gate.weight"].numpy()
            # HF keeps the experts fused in memory: gate_up [E, 2I, H], down [E, H, I]
            gate, up = state[f"{prefix}experts.gate_up_proj"].chunk(2, dim=1)
            stacks = {
                "gate_proj": gate,
                "up_proj": up,
                "down_proj": state[f"{prefix}experts.down_proj"],
            }
            for hf, stack in EXPERT_STACKS.items():
                arrays[f"blk.{index}.{stack}.weight"] = stacks[hf].contiguous().numpy()
    for hf, ours in tensors.items():
        values = state[hf].to(torch.float32)
        if name.startswith("gemma") and hf.endswith("norm.weight"):
            values = values + 1.0  # llama.cpp stores Gemma's norms as 1 + w
        if name in QK_PERMUTED and hf.endswith("q_proj.weight"):
            values = torch.from_numpy(llama_cpp_permute(values.numpy(), config.num_attention_heads))
        if name in QK_PERMUTED and hf.endswith("k_proj.weight"):
            values = torch.from_numpy(llama_cpp_permute(values.numpy(), config.num_key_value_heads))
        arrays[ours] = values.numpy()
    for ours, array in arrays.items():
        kind = matrix if array.ndim >= 2 else gguf.GGMLQuantizationType.F32
        writer.add_tensor(ours, gguf.quants.quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("matrix", ["F32", "Q8_0"])
@pytest.mark.parametrize("name", sorted(GGUF_CASES))
def test_family_gguf_round_trip(name: str, matrix: str, tmp_path: pathlib.Path) -> None:
    model = _model(name)
    path = tmp_path / f"{name}.gguf"
    _write(name, model, path, getattr(gguf.GGMLQuantizationType, matrix))
    with family_group(path, tmp_path / "cache", num_device_blocks=48) as group:
        assert group.model_info.architecture == name
        assert group.model_info.quantization == f"gguf:{matrix}"
        if name == "phi3":  # the long factors, unused by these short sequences, read back too
            rope = read_spec(path).rope
            config_rope = model.config.rope_parameters
            assert rope.kind == "longrope" and rope.partial_rotary_factor == 0.75
            assert rope.long_factor == pytest.approx(config_rope["long_factor"])
            assert rope.short_factor == pytest.approx(config_rope["short_factor"])
        reference = _as_stored(model, matrix)
        assert_greedy_matches_hf(group, reference, [list(range(3, 20))], 6, seed=2, prefill_chunk=5)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_mixtral_gguf_at_tp2_matches_hf(
    ray_cluster: None, expert_parallel: bool, tmp_path: pathlib.Path
) -> None:
    """Each rank reads its shard of llama.cpp's expert stacks: every expert's columns split
    across the two ranks, or (expert parallel) two whole experts each."""
    model = _model("mixtral")
    path = tmp_path / "mixtral.gguf"
    _write("mixtral", model, path, gguf.GGMLQuantizationType.Q8_0)
    with family_group(
        path,
        tmp_path / "cache",
        num_device_blocks=48,
        backend="ray",
        tensor_parallel_size=2,
        enable_expert_parallel=expert_parallel,
    ) as group:
        reference = _as_stored(model, "Q8_0")
        assert_greedy_matches_hf(group, reference, [list(range(3, 20))], 6, seed=2, prefill_chunk=5)
