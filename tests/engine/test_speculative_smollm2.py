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
from collections.abc import Callable
from dataclasses import dataclass

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


GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=1, max_tokens=48, ignore_eos=True)
CASES = {"float32": {"greedy": GREEDY, "seeded": SEEDED}, "bfloat16": {"greedy": GREEDY}}
"""Per dtype, the sampling runs one engine of that dtype serves in turn (an engine load costs
more than a run): the same prompts, so the prefix cache is in the same state in both engines
when a run starts."""


@dataclass(frozen=True)
class Run:
    """One sampling run's tokens (random prompts, then chats) and the speculation counters it
    moved (None: no speculation)."""

    tokens: list[list[int]]
    counters: SpeculationCounters | None


def _counters(llm: LLM) -> SpeculationCounters | None:
    counters = llm.metrics().speculation
    return None if counters is None else counters.copy()


def _moved(
    before: SpeculationCounters | None, after: SpeculationCounters | None
) -> SpeculationCounters | None:
    if before is None or after is None:
        return None
    return SpeculationCounters(
        after.num_drafts - before.num_drafts,
        after.num_draft_tokens - before.num_draft_tokens,
        after.num_accepted_tokens - before.num_accepted_tokens,
    )


def _generate(speculative: dict[str, object] | None, dtype: str) -> dict[str, Run]:
    kwargs = {} if speculative is None else {"speculative_config": speculative}
    runs = {}
    with LLM(dtype=dtype, max_model_len=1024, check_integrity=True, **kwargs) as llm:
        before = _counters(llm)
        for name, params in CASES[dtype].items():
            random_out = llm.generate(_random_prompts(6, 96), params)
            chat_out = llm.chat([[{"role": "user", "content": c}] for c in CHATS], params)
            after = _counters(llm)
            tokens = [o.outputs[0].token_ids for o in random_out + chat_out]
            runs[name] = Run(tokens, _moved(before, after))
            before = after
    return runs


@pytest.fixture(scope="module")
def runs() -> Callable[[str], tuple[dict[str, Run], dict[str, Run]]]:
    """Per dtype, plain decoding's and the shipped speculation's runs (computed on first use)."""
    done: dict[str, tuple[dict[str, Run], dict[str, Run]]] = {}

    def of(dtype: str) -> tuple[dict[str, Run], dict[str, Run]]:
        if dtype not in done:
            done[dtype] = (_generate(None, dtype), _generate(SHIPPED, dtype))
        return done[dtype]

    return of


@pytest.mark.parametrize(
    ("dtype", "sampling"),
    [("float32", "greedy"), ("float32", "seeded"), ("bfloat16", "greedy")],
    ids=["float32-greedy", "float32-seeded", "bfloat16-greedy"],
)
def test_shipped_speculation_gives_the_plain_tokens(
    runs: Callable[[str], tuple[dict[str, Run], dict[str, Run]]], dtype: str, sampling: str
) -> None:
    plain_runs, fast_runs = runs(dtype)
    plain, fast = plain_runs[sampling], fast_runs[sampling]
    assert plain.counters is None and fast.counters is not None
    assert fast.tokens == plain.tokens
    counters = fast.counters
    assert counters.num_draft_tokens > counters.num_accepted_tokens > 0, counters
