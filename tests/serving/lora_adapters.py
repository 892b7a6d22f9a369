"""The PEFT adapters of the tiny model that the served LoRA tests load (built by PEFT itself on
HF's model of the tiny Llama; `tests/lora/adapters.py`)."""

from __future__ import annotations

import pathlib

import transformers
from safetensors.torch import load_file, save_file

from tests.lora.adapters import ALL_PROJECTIONS, build_adapter, copy_adapter


def _narrow_q(directory: pathlib.Path) -> None:
    weights = directory / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    name = sorted(n for n in tensors if "q_proj.lora_A" in n)[0]
    tensors[name] = tensors[name][:, :64].contiguous()
    save_file(tensors, str(weights))


def build_serving_adapters(root: pathlib.Path, model_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    """`a` and `b` (rank 8, all projections, other seeds), `a_copy` (a's files elsewhere),
    `rank32` (over the apps' max_lora_rank 16), `malformed` (a config that is not JSON) and
    `wrong_shape` (a's q_proj lora_A cut to 64 input features), under `root`."""
    paths: dict[str, pathlib.Path] = {}
    for name, rank, seed in (("a", 8, 1), ("b", 8, 2), ("rank32", 32, 3)):
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
        build_adapter(base, root / name, rank=rank, targets=ALL_PROJECTIONS, seed=seed)
        paths[name] = root / name
    paths["a_copy"] = copy_adapter(paths["a"], root / "a_copy")
    paths["malformed"] = copy_adapter(paths["a"], root / "malformed")
    (paths["malformed"] / "adapter_config.json").write_text("{not json")
    paths["wrong_shape"] = copy_adapter(paths["a"], root / "wrong_shape")
    _narrow_q(paths["wrong_shape"])
    return paths
