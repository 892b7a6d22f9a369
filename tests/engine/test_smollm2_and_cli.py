"""The real default model end to end, and the `pagedserve generate` command line."""

from __future__ import annotations

import json
import pathlib

import pytest

from cluster.serving.cli import main
from pagedserve import LLM, SamplingParams


@pytest.mark.smollm2
def test_smollm2_default_model_answers_through_the_facade() -> None:
    with LLM(kv_cache_bytes=16 * 2**20, max_model_len=256, check_integrity=True) as llm:
        text_result, ids_result = llm.generate(
            ["The capital of France is", {"prompt_token_ids": [504, 3575, 282, 4649, 314]}],
            SamplingParams(temperature=0.0, max_tokens=4),
        )
        assert "Paris" in text_result.outputs[0].text
        assert text_result.outputs[0].finish_reason == "length"
        assert ids_result.outputs[0].token_ids == text_result.outputs[0].token_ids
        # The bare question is a near-tie in float32 ("The" over "L" by 0.08 logits), so its
        # answer would follow the rounding of the dtype the CPU picks, not the model.
        chat = llm.chat(
            [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
            SamplingParams(temperature=0.0, max_tokens=12),
        )[0]
        assert "Paris" in chat.outputs[0].text
        assert chat.prompt is not None and chat.prompt.startswith("<|im_start|>")
        assert llm.metrics().pressure.device.used == 0


def test_cli_generate_prints_json(
    tiny_model_dir: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["generate", "--model", str(tiny_model_dir), "--max-tokens", "5", "--json", "--raw",
         "--n", "2", "--temperature", "1.0", "--seed", "3", "Hello there"]
    )  # fmt: skip
    assert code == 0
    record = json.loads(capsys.readouterr().out.strip())
    assert record["prompt"] == "Hello there" and len(record["outputs"]) == 2
    assert all(len(o["token_ids"]) == 5 for o in record["outputs"])


def test_cli_refuses_a_bad_setting_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--block-size", "12"]) == 2
    assert "cache.block_size" in capsys.readouterr().err
