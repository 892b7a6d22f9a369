"""Speculative decoding on the default model with the shipped speculative settings: the same
tokens as plain decoding.

The prompts are the side-by-side benchmark's (random token ids, whose greedy continuations loop,
so most drafts are accepted) and chat prompts (natural text, where fewer are). Draft rows are
one-token decodes, so every kept row's logits are the ones plain decoding computes for that
position wherever the model's products do not depend on the batch's rows: float32, greedy and
seeded, must match plain decoding token for token.

bfloat16 (what `make serve` runs) already depends on the batch without speculation: a step with
a prompt chunk multiplies with oneDNN's bfloat16 product instead of the 4-bit kernels, so a
seeded request's tokens change with what runs beside it (several of these random prompts
differ alone and together). Speculation changes which steps a position lands in, so
seeded bfloat16 sampling is only as reproducible as it was; greedy bfloat16, whose decisions
only move at near ties, is checked to match.
"""

from __future__ import annotations

import random

import pytest

from cluster.engine.llm import LLM
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.speculation import SpeculationCounters

pytestmark = pytest.mark.smollm2

SHIPPED = {"method": "ngram", "num_speculative_tokens": 3, "max_rows": 8}
"""`cluster/serving/serve_config.yaml`'s speculative section, in vLLM's keys."""
CHATS = [
    "Explain how a hash map works.",
    "Write a short poem about the sea.",
    "List five tips for better sleep.",
    "What is the difference between TCP and UDP?",
]


def _random_prompts(count: int, length: int) -> list[dict[str, list[int]]]:
    rng = random.Random(0)
    return [
        {"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(length)]}
        for _ in range(count)
    ]


def _generate(
    speculative: dict[str, object] | None, params: SamplingParams, dtype: str
) -> tuple[list[list[int]], SpeculationCounters | None]:
    kwargs = {} if speculative is None else {"speculative_config": speculative}
    with LLM(dtype=dtype, max_model_len=1024, check_integrity=True, **kwargs) as llm:
        random_out = llm.generate(_random_prompts(6, 96), params)
        chat_out = llm.chat([[{"role": "user", "content": c}] for c in CHATS], params)
        counters = llm.metrics().speculation
    tokens = [o.outputs[0].token_ids for o in random_out + chat_out]
    return tokens, counters


GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=1, max_tokens=48, ignore_eos=True)


@pytest.mark.parametrize(
    ("dtype", "params"),
    [("float32", GREEDY), ("float32", SEEDED), ("bfloat16", GREEDY)],
    ids=["float32-greedy", "float32-seeded", "bfloat16-greedy"],
)
def test_shipped_speculation_gives_the_plain_tokens(dtype: str, params: SamplingParams) -> None:
    plain, none = _generate(None, params, dtype)
    fast, counters = _generate(SHIPPED, params, dtype)
    assert none is None and counters is not None
    assert fast == plain
    assert counters.num_draft_tokens > counters.num_accepted_tokens > 0, counters
