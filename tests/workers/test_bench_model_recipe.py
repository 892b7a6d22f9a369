"""The benchmark model's recipe (`benchmarks.make_bench_model`) writes a GGUF that HF
transformers and our workers read as the same Llama, deterministically from its seed.

Run on a tiny shape (the 1B one takes minutes and gigabytes): the same tensor plan, scales,
metadata and writer. Oracle: HF's own GGUF loader, greedy tokens and float32 logits.
"""

from __future__ import annotations

import hashlib
import pathlib
from collections.abc import Iterator

import pytest
import torch
import transformers

from benchmarks.make_bench_model import EMBED_STD, SHAPE, tensor_plan, write_f16
from tests.hf_gguf import gguf_parsed_once, hf_model_from_gguf
from tests.workers.paged_runner import greedy_generate, hf_greedy
from workers import WorkerConfig, WorkerGroup, load_tokenizer

TINY = transformers.LlamaConfig(
    **{
        **SHAPE.to_dict(),
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 256,
    }
)
PROMPTS = [[504, 3575, 314, 4303, 28], [1, 9468, 30, 216]]


@pytest.fixture(scope="module")
def shipped_header_parsed_once() -> Iterator[None]:
    """Every recipe write copies the shipped model's tokenizer fields from its GGUF header: the
    module's writes parse that header once (`tests.hf_gguf.gguf_parsed_once`)."""
    with gguf_parsed_once():
        yield


@pytest.fixture(scope="module")
def tiny_file(
    tmp_path_factory: pytest.TempPathFactory, shipped_header_parsed_once: None
) -> pathlib.Path:
    return write_f16(tmp_path_factory.mktemp("bench_recipe") / "tiny.gguf", TINY, seed=3)


def test_the_recipe_has_llama_3_2_1b_shape() -> None:
    plan = {name: shape for name, shape, _ in tensor_plan(SHAPE)}
    assert plan["blk.0.attn_q.weight"] == (2048, 2048)
    assert plan["blk.0.attn_k.weight"] == (512, 2048)
    assert plan["blk.0.ffn_down.weight"] == (2048, 8192)
    assert "output.weight" not in plan  # tied, as Llama-3.2-1B
    matrices = sum(shape[0] * shape[1] for shape in plan.values() if len(shape) == 2)
    assert 1.07e9 < matrices < 1.08e9  # 1.074 B: Llama-3.2-1B's 1.236 B with 49152 ids, not 128256


def test_the_same_seed_writes_the_same_bytes(
    tiny_file: pathlib.Path, tmp_path: pathlib.Path, shipped_header_parsed_once: None
) -> None:
    again = write_f16(tmp_path / "again.gguf", TINY, seed=3)
    other = write_f16(tmp_path / "other.gguf", TINY, seed=4)
    digest = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in (tiny_file, again, other)}
    assert digest[tiny_file] == digest[again] != digest[other]


def test_workers_and_hf_read_the_recipe_alike(tiny_file: pathlib.Path) -> None:
    reference = hf_model_from_gguf(tiny_file)
    group = WorkerGroup(
        WorkerConfig(
            model=str(tiny_file),
            dtype="float32",
            backend="local",
            block_size=4,
            num_device_blocks=64,
            weights_cache_dir=str(tiny_file.parent / "cache"),
        )
    )
    try:
        run = greedy_generate(group, PROMPTS, 8)
    finally:
        group.shutdown()
    for index, prompt in enumerate(PROMPTS):
        tokens, logits = hf_greedy(reference, prompt, 8)
        assert run.tokens[index] == tokens
        torch.testing.assert_close(run.logits[index], logits, atol=2e-3, rtol=0)
        assert bool(torch.isfinite(logits).all())
        # RMS-normed states times the tied embedding: logits of std EMBED_STD * sqrt(hidden)
        expected = EMBED_STD * TINY.hidden_size**0.5
        assert 0.7 * expected < float(logits.std()) < 1.3 * expected
    # the shipped model's tokenizer and chat template travel with the file
    tokenizer = load_tokenizer(str(tiny_file), cache_dir=str(tiny_file.parent / "cache"))
    assert len(tokenizer) == 49152 and tokenizer.chat_template
