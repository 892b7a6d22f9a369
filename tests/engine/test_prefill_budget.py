"""`scheduler.max_prefill_tokens`: while any sequence decodes, prompt chunks take at most the cap
per step (decodes keep their whole budget), the tokens stay those of the paging-free reference,
and with nothing decoding a prompt may use the whole step budget."""

from __future__ import annotations

import pytest

from cluster.engine.config import EngineConfig
from cluster.engine.errors import ConfigError
from cluster.engine.outputs import RequestOutput
from cluster.engine.sampling_params import SamplingParams
from tests.engine.conftest import SlotEngineFactory
from tests.engine.slot_workers import reference_tokens
from tests.engine.test_paging_slot_model import assert_all_blocks_free

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def test_prompt_chunks_are_capped_only_while_something_decodes(
    slot_engine: SlotEngineFactory,
) -> None:
    cap, budget = 8, 48
    engine = slot_engine(
        num_device_blocks=128,
        scheduler={"max_num_batched_tokens": budget, "max_prefill_tokens": cap},
    )
    prompts = [[300 + i % 20 for i in range(40)], [301 + i % 17 for i in range(60)]]
    first = engine.add_request(
        engine.request_builder.build({"prompt_token_ids": prompts[0]}, GREEDY)
    )
    finals: dict[str, RequestOutput] = {}
    steps = 0
    seen_capped = False
    while engine.has_unfinished() or steps == 0:
        if steps == 2:  # the first prompt is computed and decoding by now
            engine.add_request(
                engine.request_builder.build({"prompt_token_ids": prompts[1]}, GREEDY)
            )
        step = engine.begin_step()
        decodes = [w for w in step.works if w.start >= len(w.request.prompt_token_ids)]
        prefill = sum(w.num_tokens for w in step.works if w.start < len(w.request.prompt_token_ids))
        assert sum(w.num_tokens for w in step.works) <= budget
        if steps == 0:
            assert prefill == len(prompts[0])  # nothing decodes: the whole prompt in one step
        if decodes:
            assert prefill <= cap
            seen_capped = seen_capped or prefill == cap
        for request in engine.finish_step(step, engine.execute(step)):
            if request.finished:
                finals[request.request_id] = request.make_output()
        steps += 1
        assert steps < 500, "no progress"
    assert seen_capped
    assert first.request_id in finals and len(finals) == 2
    for output, prompt in zip(
        sorted(finals.values(), key=lambda o: o.request_id != first.request_id),
        prompts,
        strict=True,
    ):
        expected = reference_tokens(prompt, GREEDY.to_settings(0), branch_index=0, max_tokens=12)
        assert output.outputs[0].token_ids == expected
    assert_all_blocks_free(engine)


def test_the_cap_is_validated() -> None:
    assert EngineConfig().scheduler.max_prefill_tokens is None
    with pytest.raises(ConfigError, match="max_prefill_tokens"):
        EngineConfig.build({"scheduler": {"max_prefill_tokens": 0}})
    with pytest.raises(ConfigError, match="max_prefill_tokens"):
        EngineConfig.build(
            {
                "model": {"max_model_len": 256},
                "scheduler": {
                    "max_prefill_tokens": 64,
                    "enable_chunked_prefill": False,
                    "max_num_batched_tokens": 256,
                },
            }
        )
