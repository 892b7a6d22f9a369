"""Structured outputs in the engine, on the tiny random Llama: every output that stops satisfies
its constraint (checked with `jsonschema` and `re`, independent of the grammar backend) under
parallel sampling, recompute and swap preemption and speculative decoding; the mask never
touches an unconstrained request of the same batch; a greedy constrained output is the argmax of
the HF model's logits over the tokens a fresh matcher allows at each position."""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

import jsonschema
import pytest
import torch
import transformers

from cluster.engine.errors import RequestRejected
from cluster.engine.llm import LLM
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.structured_outputs import ConstraintError, StructuredOutputsParams
from tests.engine.tiny_engine import assert_all_free, tiny_config

# The Ray tests here run Ray core actors only (no Serve): beside the Serve tests under xdist.
pytestmark = pytest.mark.plain_ray

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "color", "size"],
}
COMPACT_JSON = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
PROMPTS = [
    'Answer in JSON: {"ok": true, "color": "red", "size": 3} and {"ok": false, "color": "red"',
    "The quick brown fox",
    "A much longer prompt that spans several blocks of the cache, written so that chunked "
    "prefill and preemption have real work to do when the pool is small.",
]
PRESSURE = {
    "recompute": {
        "cache": {"num_device_blocks": 24, "block_size": 4},
        "scheduler": {"preemption_mode": "recompute"},
    },
    "swap": {
        "cache": {"num_device_blocks": 24, "block_size": 4},
        "scheduler": {"preemption_mode": "swap"},
    },
    "chunked_prefill": {
        "scheduler": {"max_num_batched_tokens": 16, "enable_chunked_prefill": True},
    },
    "speculation": {
        "speculative": {
            "speculative_method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
        }
    },
}


def _valid_json(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def _constrained(n: int = 1, seed: int = 7, **kwargs: Any) -> SamplingParams:
    return SamplingParams(
        n=n, temperature=0.9, seed=seed, max_tokens=48, structured_outputs=COMPACT_JSON, **kwargs
    )


def test_json_outputs_validate_with_parallel_sampling(tiny_model_dir: pathlib.Path) -> None:
    with LLM(config=tiny_config(tiny_model_dir)) as llm:
        outputs = llm.generate(PROMPTS, _constrained(n=3))
        assert_all_free(llm)
    branches = [c for o in outputs for c in o.outputs]
    assert len(branches) == 9
    assert all(c.finish_reason == "stop" for c in branches), [c.text for c in branches]
    assert all(_valid_json(c.text) for c in branches), [c.text for c in branches]
    assert len({c.text for c in branches}) > 1  # n branches sample independently


@pytest.mark.parametrize("regime", sorted(PRESSURE))
def test_json_outputs_validate_under_pressure(tiny_model_dir: pathlib.Path, regime: str) -> None:
    """Same seeded outputs as a roomy engine's, every one valid: preemption (the matcher stays
    with the branch's kept tokens), drafts (checked against the matcher), prompts prefilled in
    chunks and from the prefix cache change nothing."""
    prompts = PROMPTS * 2
    params = [_constrained(seed=s) for s in range(len(prompts))]
    with LLM(config=tiny_config(tiny_model_dir)) as llm:
        roomy = [o.outputs[0].text for o in llm.generate(prompts, params)]
    with LLM(config=tiny_config(tiny_model_dir, **PRESSURE[regime])) as llm:
        outputs = llm.generate(prompts, params)
        metrics = llm.metrics()
        assert_all_free(llm)
    texts = [o.outputs[0].text for o in outputs]
    assert texts == roomy
    assert all(_valid_json(t) for t in texts), texts
    if regime == "speculation":
        assert metrics.speculation is not None and metrics.speculation.num_draft_tokens > 0
    elif regime == "chunked_prefill":  # the repeated prompts also hit the prefix cache
        assert metrics.prefix_cache_hit_rate > 0
    else:
        assert metrics.preemptions > 0


def test_unconstrained_rows_are_untouched(tiny_model_dir: pathlib.Path) -> None:
    """An unconstrained request batched with constrained ones draws exactly the tokens it draws
    alone (greedy and seeded), and is not cut to the grammar."""
    plain = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True),
    ]
    with LLM(config=tiny_config(tiny_model_dir)) as llm:
        alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], plain)]
        mixed = llm.generate(
            [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]],
            [_constrained(seed=1), plain[0], _constrained(seed=2), plain[1]],
        )
    assert [mixed[1].outputs[0].token_ids, mixed[3].outputs[0].token_ids] == alone
    assert _valid_json(mixed[0].outputs[0].text) and _valid_json(mixed[2].outputs[0].text)


def test_regex_and_choice_and_grammar(tiny_model_dir: pathlib.Path) -> None:
    kinds = [
        StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"),
        StructuredOutputsParams(choice=["yes", "no", "maybe not"]),
        StructuredOutputsParams(grammar='root ::= "(" [a-c]+ ")" | "none"'),
        StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
    ]
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured_outputs=k)
        for s, k in enumerate(kinds)
    ]
    with LLM(config=tiny_config(tiny_model_dir)) as llm:
        texts = [o.outputs[0].text for o in llm.generate(["Hello"] * 4, params)]
        outputs = llm.generate(["Hello"] * 4, params)
    assert [o.outputs[0].text for o in outputs] == texts  # seeded: reproducible
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs[:3])
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", texts[0])
    assert texts[1] in {"yes", "no", "maybe not"}
    assert re.fullmatch(r"\([a-c]+\)|none", texts[2])
    if outputs[3].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(texts[3]), dict)


def test_greedy_constrained_output_is_masked_argmax(
    tiny_model_dir: pathlib.Path, tiny_hf: transformers.PreTrainedModel
) -> None:
    """Oracle: HF transformers with the same weights, teacher-forced on the engine's output;
    at each position the engine's token must be the argmax over what a fresh matcher allows."""
    import xgrammar as xgr

    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=COMPACT_JSON)
    with LLM(config=tiny_config(tiny_model_dir)) as llm:
        output = llm.generate([PROMPTS[1]], params)[0]
        tokenizer = llm.engine.tokenizer
        vocab = llm.engine.model_info.vocab_size
    prompt_ids, generated = output.prompt_token_ids, output.outputs[0].token_ids
    with torch.no_grad():
        logits = tiny_hf(torch.tensor([prompt_ids + generated])).logits[0, len(prompt_ids) - 1 :]
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[2])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False
    )
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab)
    for position, token in enumerate(generated):
        matcher.fill_next_token_bitmask(mask, 0)
        row = logits[position].clone()
        xgr.apply_token_bitmask_inplace(row.unsqueeze(0), mask)
        assert token == int(torch.argmax(row)), position
        assert matcher.accept_token(token)
    assert matcher.is_terminated()
    assert _valid_json(output.outputs[0].text)


@pytest.mark.parametrize(
    ("constraint", "field"),
    [
        ({"json": {"type": "nope"}}, "structured_outputs.json"),
        ({"regex": "(?=a)b"}, "structured_outputs.regex"),
        ({"grammar": "root ::= "}, "structured_outputs.grammar"),
        ({"regex": "a" * 70_000}, "structured_outputs.regex"),
    ],
)
def test_bad_constraints_are_refused_naming_the_field(
    tiny_model_dir: pathlib.Path, constraint: dict[str, Any], field: str
) -> None:
    structured = StructuredOutputsParams(**constraint)
    with LLM(config=tiny_config(tiny_model_dir)) as llm:
        with pytest.raises(RequestRejected, match=re.escape(field)):
            llm.generate(["Hello"], SamplingParams(structured_outputs=structured))
        assert not llm.engine.has_unfinished()
        assert llm.generate(["Hello"], SamplingParams(max_tokens=2))[0].finished


def test_params_need_exactly_one_constraint() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ConstraintError, match=r"structured_outputs\.choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ConstraintError, match=r"structured_outputs\.json"):
        StructuredOutputsParams(json="{not json")


def test_compile_cache_keys_on_the_exact_constraint(tiny_model_dir: pathlib.Path) -> None:
    with LLM(config=tiny_config(tiny_model_dir)) as llm:
        cache = llm.engine.grammars
        first = cache.compile(COMPACT_JSON.spec)
        assert cache.compile(StructuredOutputsParams(json=dict(SCHEMA)).spec) is not first
        assert cache.compile(COMPACT_JSON.spec) is first
        assert (cache.stats.hits, cache.stats.misses) == (1, 2)


def test_a_slow_compile_never_stalls_other_requests(
    tiny_model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The async engine compiles in a worker thread: while one constraint takes its time, an
    unconstrained request runs to the end; a compile past the time limit is refused naming the
    field, and the engine goes on."""
    import asyncio
    import threading

    from cluster.engine import async_engine
    from cluster.engine.async_engine import AsyncEngine
    from tests.engine.streams import engine_outputs

    release = threading.Event()

    async def scenario() -> None:
        engine = AsyncEngine(tiny_config(tiny_model_dir))
        compile_now = engine.core.grammars.compile

        def slow_compile(spec: Any) -> Any:
            release.wait(timeout=60)
            return compile_now(spec)

        monkeypatch.setattr(engine.core.grammars, "compile", slow_compile)
        builder = engine.request_builder
        constrained = builder.build("Hello", _constrained(seed=1), request_id="slow")
        plain = builder.build(
            "Hello", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        )

        async def last(request: Any) -> Any:
            final = None
            async for output in engine_outputs(engine, request):
                final = output
            return final

        slow = asyncio.create_task(last(constrained))
        done = await asyncio.wait_for(last(plain), timeout=120)
        assert done.finished and len(done.outputs[0].token_ids) == 8
        assert not slow.done()  # still compiling while the other request ran to the end
        release.set()
        assert _valid_json((await asyncio.wait_for(slow, timeout=120)).outputs[0].text)
        release.clear()
        monkeypatch.setattr(async_engine, "GRAMMAR_COMPILE_TIMEOUT_S", 0.2)
        late = builder.build("Hi", _constrained(seed=2), request_id="late")
        with pytest.raises(RequestRejected, match=r"structured_outputs\.json: .* did not compile"):
            await last(late)
        release.set()
        await engine.shutdown()

    asyncio.run(scenario())


def test_tensor_parallel_two_gives_the_same_constrained_outputs(
    tiny_model_dir: pathlib.Path, ray_cluster: object
) -> None:
    """Every rank gets the plan's bitmasks; only rank 0 samples: the greedy outputs equal
    TP = 1's (sampled ones could differ at a near-tie of the sharded sums)."""
    prompts = PROMPTS
    params = SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=COMPACT_JSON)
    with LLM(config=tiny_config(tiny_model_dir)) as llm:
        single = [[c.text for c in o.outputs] for o in llm.generate(prompts, params)]
    config = tiny_config(tiny_model_dir, parallel={"backend": "ray", "tensor_parallel_size": 2})
    with LLM(config=config) as llm:
        outputs = llm.generate(prompts, params)
    assert [[c.text for c in o.outputs] for o in outputs] == single
    assert all(_valid_json(c.text) for o in outputs for c in o.outputs)


def test_a_draft_that_ends_the_grammar_gets_masks_not_a_crash(
    tiny_model_dir: pathlib.Path,
) -> None:
    """An n-gram draft may be the stop token right where the grammar completes (a prompt that
    shows the answer's form ends it so): the drafts up to it are valid, their masks are the
    grammar's, and the row after the stop token is never read (the branch ends there)."""
    with LLM(config=tiny_config(tiny_model_dir)) as llm:
        compiled = llm.engine.grammars.compile(StructuredOutputsParams(choice=["yes"]).spec)
        tokenizer = llm.get_tokenizer()
        answer = tokenizer.encode("yes", add_special_tokens=False)
        stop = tokenizer.eos_token_id
        grammar = compiled.new_matcher()
        drafts = [*answer, stop, answer[0]]
        assert grammar.valid_drafts(drafts) == len(answer) + 1  # the stop token ends them
        masks = grammar.bitmasks(drafts[: len(answer) + 1])
        assert masks.shape[0] == len(answer) + 2
        for row, token in enumerate([*answer, stop]):  # each draft allowed where it stands
            word, bit = divmod(token, 32)
            assert (int(masks[row, word]) >> bit) & 1
        first_word, first_bit = divmod(answer[0], 32)
        assert not (int(masks[len(answer), first_word]) >> first_bit) & 1  # only the stop
        assert grammar.num_accepted == 0 and not grammar.is_terminated  # state unchanged
