"""Models we cannot run are refused at load, before any rank starts, with a message naming the
field and what is supported."""

from __future__ import annotations

import json
import pathlib

import gguf
import numpy as np
import pytest

from tests.workers.gguf_writer import write_iq4_nl_gguf
from tests.workers.tiny_families import write_family_model
from workers import WorkerConfig, WorkerGroup
from workers.loader import read_spec


def _group(model: pathlib.Path, tmp_path: pathlib.Path, **settings: object) -> WorkerGroup:
    return WorkerGroup(
        WorkerConfig(
            dtype="float32",
            model=str(model),
            num_device_blocks=8,
            weights_cache_dir=str(tmp_path / "cache"),
            **settings,  # type: ignore[arg-type]
        )
    )


def test_an_unknown_architecture_lists_the_supported(tmp_path: pathlib.Path) -> None:
    model = tmp_path / "qwen3"
    write_family_model("qwen3", model)
    config = json.loads((model / "config.json").read_text())
    config.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unknown model architecture 'DeepseekV3ForCausalLM'.*"
                       r"'gemma2', 'gemma3', 'llama', 'mistral', 'mixtral', 'phi3'"):  # fmt: skip
        _group(model, tmp_path, backend="local")


def test_an_unreadable_gguf_type_is_named(tmp_path: pathlib.Path) -> None:
    path = write_iq4_nl_gguf(tmp_path / "iq.gguf")
    with pytest.raises(ValueError, match=r"'token_embd.weight' has type IQ4_NL.*supported: F32"):
        _group(path, tmp_path, backend="local")


def test_expert_parallel_degrees_the_model_cannot_split(tmp_path: pathlib.Path) -> None:
    moe = tmp_path / "qwen3_moe"
    write_family_model("qwen3_moe", moe)  # 6 experts
    # the degrees offered split the heads (4) as well as the experts
    expected = r"4 does not divide the model's 6 experts \(the model has 4 attention heads .*"
    with pytest.raises(ValueError, match=expected + r"may be one of \[1, 2\]\)"):
        _group(moe, tmp_path, tensor_parallel_size=4, enable_expert_parallel=True)
    dense = tmp_path / "qwen3"
    write_family_model("qwen3", dense)
    with pytest.raises(ValueError, match="enable_expert_parallel needs a mixture-of-experts"):
        _group(dense, tmp_path, tensor_parallel_size=2, enable_expert_parallel=True)


def _metadata_only_gguf(path: pathlib.Path, architecture: str, experts: int, tensor: str) -> None:
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_embedding_length(32)
    writer.add_block_count(1)
    writer.add_head_count(1)
    writer.add_feed_forward_length(32)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((64, 32), dtype=np.float32))
    writer.add_tensor(tensor, np.zeros((32, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    ("architecture", "experts", "tensor", "message"),
    [
        ("deepseek2", 4, "blk.0.ffn_gate_exps.weight", r"'deepseek2' with 4 experts \(GGUF "),
        ("qwen3", 4, "blk.0.ffn_gate_exps.weight", r"'qwen3' with 4 experts.*'llama with expe"),
        ("qwen3moe", 0, "blk.0.ffn_gate.weight", r"'qwen3moe' \(GGUF general.architecture\)"),
        # llama.cpp's Mixtral from before the expert stacks: one tensor per expert
        ("llama", 8, "blk.0.ffn_gate.0.weight", r"only expert stacks .* are supported"),
    ],
)
def test_gguf_architectures_we_do_not_run_are_named_with_the_supported(
    tmp_path: pathlib.Path, architecture: str, experts: int, tensor: str, message: str
) -> None:
    path = tmp_path / "model.gguf"
    _metadata_only_gguf(path, architecture, experts, tensor)
    with pytest.raises(ValueError, match=message):
        read_spec(path)
    with pytest.raises(ValueError, match=message):
        _group(path, tmp_path, backend="local")
