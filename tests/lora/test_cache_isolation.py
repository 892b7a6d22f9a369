"""Prefix caching across adapters, through the engine's cached-token counts: the same prompt
under two adapters (or an adapter and the base model) shares no block; the same weights copied
to another directory and served under another name share every block."""

from __future__ import annotations

import pathlib

from cluster.engine.llm import LLM
from cluster.engine.lora_request import LoRARequest
from cluster.engine.sampling_params import SamplingParams
from tests.engine.tiny_engine import tiny_config
from tests.lora.adapters import copy_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = (
    "A long prompt that spans several blocks of the cache so that a prefix hit is worth "
    "whole blocks, written once and asked again under other adapters."
)


def test_blocks_shared_by_weights_never_by_name(
    tiny_model_dir: pathlib.Path, tiny_adapters: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    a = LoRARequest("all8", 1, str(tiny_adapters["all8"]))
    b = LoRARequest("qv16", 2, str(tiny_adapters["qv16"]))
    a_copy = LoRARequest("all8-copy", 3, str(copy_adapter(tiny_adapters["all8"], tmp_path / "c")))
    config = tiny_config(tiny_model_dir, lora={"enable_lora": True, "max_lora_rank": 16})
    with LLM(config=config) as llm:

        def run(lora: LoRARequest | None) -> tuple[int, list[int]]:
            output = llm.generate(PROMPT, GREEDY, lora_request=lora)[0]
            return output.num_cached_tokens, output.outputs[0].token_ids

        prompt_len = len(llm.engine.request_builder.build(PROMPT, GREEDY).token_ids)
        block = llm.config.cache.block_size
        full_blocks = (prompt_len - 1) // block * block  # the last token's block is recomputed
        assert full_blocks >= 3 * block
        first_a, tokens_a = run(a)
        again_a, tokens_a2 = run(a)
        assert (first_a, again_a) == (0, full_blocks) and tokens_a2 == tokens_a
        cached_b, tokens_b = run(b)
        cached_base, tokens_base = run(None)
        assert (cached_b, cached_base) == (0, 0)  # other weights: no block of a's is used
        again_b, _ = run(b)
        assert again_b == full_blocks  # b's own blocks are cached (so the 0 above is isolation)
        cached_copy, tokens_copy = run(a_copy)
        assert cached_copy == full_blocks and tokens_copy == tokens_a
        assert len({tuple(tokens_a), tuple(tokens_b), tuple(tokens_base)}) == 3
        keys = llm.engine.request_keys
        build = llm.engine.request_builder.build
        hashes = {
            name: keys.block_hashes(build(PROMPT, GREEDY, adapter=name))
            for name in ("all8", "all8-copy", "qv16")
        }
        base_hashes = keys.block_hashes(build(PROMPT, GREEDY))
        assert hashes["all8"] == hashes["all8-copy"]
        assert not set(hashes["all8"]) & set(hashes["qv16"])
        assert not set(hashes["all8"]) & set(base_hashes)
