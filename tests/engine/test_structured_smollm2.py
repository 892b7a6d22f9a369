"""Structured outputs with the default model (SmolLM2-135M-Instruct), where the model matters:
chat answers under a JSON schema (free whitespace, the vLLM default) validate with `jsonschema`
for n = 3 sampled branches, with speculative decoding on and with swap preemption, and the
schema's required fields are filled with what the model writes."""

from __future__ import annotations

import json

import jsonschema
import pytest

from cluster.engine.llm import LLM
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.structured_outputs import StructuredOutputsParams

pytestmark = pytest.mark.smollm2

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "population": {"type": "integer", "minimum": 0},
    },
    "required": ["city", "country", "population"],
}
CONVERSATIONS = [
    [{"role": "user", "content": "Name a large city as JSON with its population."}],
    [{"role": "user", "content": "Which city is the capital of Japan? Reply in JSON."}],
]
SETTINGS = {
    "speculation": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    "swap": {"num_device_blocks": 12, "block_size": 16, "preemption_mode": "swap"},
}


@pytest.mark.parametrize("regime", sorted(SETTINGS))
def test_smollm2_json_answers_validate(regime: str) -> None:
    params = SamplingParams(
        n=3,
        temperature=0.7,
        seed=5,
        max_tokens=120,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )
    with LLM(max_model_len=512, check_integrity=True, **SETTINGS[regime]) as llm:
        outputs = llm.chat(CONVERSATIONS, params)
        metrics = llm.metrics()
    branches = [c for o in outputs for c in o.outputs]
    stopped = [c for c in branches if c.finish_reason == "stop"]
    assert len(stopped) >= 4, [c.text for c in branches]
    for completion in stopped:
        answer = json.loads(completion.text)
        jsonschema.validate(answer, SCHEMA)
        assert answer["city"].strip()
    if regime == "swap":
        assert metrics.preemptions_swap > 0
