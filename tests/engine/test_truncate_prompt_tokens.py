"""vLLM's `truncate_prompt_tokens`: the prompt keeps only its last k tokens, rendered once; the
engine then runs exactly what a prompt of those k token ids runs (the oracle: the same engine
given the tail as `prompt_token_ids`, and HF's greedy tokens for it)."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import transformers

from cluster.engine.errors import RequestRejected
from cluster.engine.llm import LLM
from cluster.engine.sampling_params import SamplingParams
from tests.engine.tiny_engine import GREEDY, PROMPTS, hf_greedy_tokens, tiny_config


def test_a_truncated_prompt_runs_as_its_last_tokens(
    tiny_model_dir: pathlib.Path, tiny_hf: transformers.PreTrainedModel
) -> None:
    hf_model = tiny_hf
    long_prompt = PROMPTS[3]
    with LLM(config=tiny_config(tiny_model_dir, model={"max_model_len": 40})) as llm:
        full = llm.get_tokenizer().encode(long_prompt)
        assert len(full) > 20
        for keep in (1, 5, 19):
            params = dataclasses.replace(GREEDY, truncate_prompt_tokens=keep)
            [cut] = llm.generate(long_prompt, params)
            [tail] = llm.generate({"prompt_token_ids": full[-keep:]}, GREEDY)
            assert cut.prompt_token_ids == full[-keep:]
            assert cut.prompt == long_prompt  # the text stays as given
            assert cut.outputs[0].token_ids == tail.outputs[0].token_ids
            assert cut.outputs[0].token_ids == hf_greedy_tokens(hf_model, full[-keep:], 16)
        for keep in (len(full), len(full) + 7, -1):
            params = dataclasses.replace(GREEDY, max_tokens=4, truncate_prompt_tokens=keep)
            [whole] = llm.generate(long_prompt, params)
            assert whole.prompt_token_ids == full
        # longer than the context: refused as given, served once truncated
        too_long = " ".join([long_prompt] * 3)
        with pytest.raises(RequestRejected):
            llm.generate(too_long, dataclasses.replace(GREEDY, max_tokens=4))
        [fits] = llm.generate(too_long, dataclasses.replace(GREEDY, truncate_prompt_tokens=20))
        assert len(fits.prompt_token_ids) == 20 and len(fits.outputs[0].token_ids) == 16


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "3"])
def test_truncate_prompt_tokens_is_checked(bad: object) -> None:
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=bad)  # type: ignore[arg-type]
