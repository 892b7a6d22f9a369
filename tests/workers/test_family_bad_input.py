"""Models we cannot run are refused at load, before any rank starts, with a message naming the
field and what is supported."""

from __future__ import annotations

import json
import pathlib

import gguf
import numpy as np
import pytest

from tests.workers.tiny_families import write_family_model
from workers import WorkerConfig, WorkerGroup


def _group(model: pathlib.Path, tmp_path: pathlib.Path, **settings: object) -> WorkerGroup:
    return WorkerGroup(
        WorkerConfig(
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
    path = tmp_path / "iq.gguf"
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
    with pytest.raises(ValueError, match=r"'token_embd.weight' has type IQ4_NL.*supported: F32"):
        _group(path, tmp_path, backend="local")


def test_expert_parallel_degrees_the_model_cannot_split(tmp_path: pathlib.Path) -> None:
    moe = tmp_path / "qwen3_moe"
    write_family_model("qwen3_moe", moe)  # 6 experts
    expected = r"4 does not divide the model's 6 experts \(tensor_parallel_size may be one of "
    with pytest.raises(ValueError, match=expected + r"\[1, 2, 3, 6\]\)"):
        _group(moe, tmp_path, tensor_parallel_size=4, enable_expert_parallel=True)
    dense = tmp_path / "qwen3"
    write_family_model("qwen3", dense)
    with pytest.raises(ValueError, match="enable_expert_parallel needs a mixture-of-experts"):
        _group(dense, tmp_path, tensor_parallel_size=2, enable_expert_parallel=True)
