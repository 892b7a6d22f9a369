"""Request-level behaviour over `SlotWorkers`: parallel sampling shares the prompt, abort frees
everything, impossible requests are rejected, and cache identities never mix."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from block_manager import CacheIdentity, CacheKey, KVCacheManager
from cluster.engine.cache_keys import CacheKeyFactory
from cluster.engine.errors import EngineOverloaded, RequestRejected
from cluster.engine.sampling_params import SamplingParams
from tests.engine.conftest import SlotEngineFactory
from tests.engine.test_paging_slot_model import assert_all_blocks_free, run_all

PROMPT = list(range(400, 430))  # 30 tokens: 7 full blocks of 4 and a partial tail


def test_parallel_sampling_shares_prompt_blocks_and_is_seeded(
    slot_engine: SlotEngineFactory,
) -> None:
    engine = slot_engine(num_device_blocks=100)
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    engine.add_request(engine.request_builder.build({"prompt_token_ids": PROMPT}, params))
    engine.step()  # the prompt, prefilled once; four tokens sampled, the request forks
    engine.step()  # each branch appends its token: copy-on-write of the shared tail
    pressure = engine.block_manager.pressure()
    prompt_blocks = len(PROMPT) // 4 + 1
    # 7 full prompt blocks shared by all four branches + one private tail per branch
    assert pressure.device.used == prompt_blocks - 1 + 4 < 4 * prompt_blocks
    assert pressure.cow_copies == 3
    while engine.has_unfinished():
        finals = engine.step()
    texts = [o.token_ids for o in finals[0].outputs]
    assert len({tuple(t) for t in texts}) == 4
    again = run_all(engine, [PROMPT], params)[0]
    assert [o.token_ids for o in again.outputs] == texts
    other_seed = run_all(engine, [PROMPT], dataclasses.replace(params, seed=6))[0]
    assert [o.token_ids for o in other_seed.outputs] != texts
    assert_all_blocks_free(engine)


def test_abort_mid_generation_frees_every_block(slot_engine: SlotEngineFactory) -> None:
    engine = slot_engine(num_device_blocks=40, scheduler={"preemption_mode": "swap"})
    params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=50, ignore_eos=True)
    requests = [
        engine.add_request(
            engine.request_builder.build({"prompt_token_ids": [p + i for p in PROMPT]}, params)
        )
        for i in range(4)
    ]
    for _ in range(25):
        engine.step()
    assert engine.scheduler.preemptions.swap > 0 and engine.scheduler.swapped
    for request in requests:
        ended = engine.abort(request.request_id)
        assert ended is not None
        final = ended.make_output()
        assert final.finished
        assert {o.finish_reason for o in final.outputs} <= {"abort", "stop", "length"}
    assert not engine.has_unfinished()
    assert_all_blocks_free(engine)
    assert engine.abort(requests[0].request_id) is None


def test_prompt_longer_than_context_is_rejected(slot_engine: SlotEngineFactory) -> None:
    engine = slot_engine(max_model_len=32)
    with pytest.raises(RequestRejected, match=r"33 tokens; the model's context is 32"):
        engine.add_request(
            engine.request_builder.build(
                {"prompt_token_ids": list(range(300, 333))}, SamplingParams()
            )
        )


def test_prompt_larger_than_pool_is_rejected(slot_engine: SlotEngineFactory) -> None:
    engine = slot_engine(num_device_blocks=8, block_size=4)
    with pytest.raises(RequestRejected, match=r"needs 10 KV blocks .* device pool has 8"):
        engine.add_request(
            engine.request_builder.build(
                {"prompt_token_ids": list(range(300, 336))}, SamplingParams()
            )
        )
    assert not engine.has_unfinished()


def test_bad_prompts_are_rejected_with_the_reason(slot_engine: SlotEngineFactory) -> None:
    engine = slot_engine()
    with pytest.raises(RequestRejected, match="not a token id"):
        engine.add_request(
            engine.request_builder.build({"prompt_token_ids": [1, 10**9]}, SamplingParams())
        )
    with pytest.raises(RequestRejected, match="prompt_token_ids"):
        engine.add_request(engine.request_builder.build({"tokens": [1]}, SamplingParams()))
    engine.add_request(engine.request_builder.build("hello", SamplingParams(), request_id="dup"))
    with pytest.raises(RequestRejected, match="already in use"):
        engine.add_request(
            engine.request_builder.build("hello", SamplingParams(), request_id="dup")
        )


def test_full_waiting_queue_overloads(slot_engine: SlotEngineFactory) -> None:
    engine = slot_engine(scheduler={"max_waiting_requests": 2})
    engine.add_request(engine.request_builder.build("a", SamplingParams()))
    engine.add_request(engine.request_builder.build("b", SamplingParams()))
    with pytest.raises(EngineOverloaded, match="max_waiting_requests"):
        engine.add_request(engine.request_builder.build("c", SamplingParams()))


def _cached_tokens(engine: Any, prompt: Any, **kwargs: Any) -> int:
    request = engine.add_request(
        engine.request_builder.build(
            prompt, SamplingParams(temperature=0.0, max_tokens=2), **kwargs
        )
    )
    cached = None
    while engine.has_unfinished():
        for output in engine.step():
            if output.request_id == request.request_id:
                cached = output.num_cached_tokens
    assert cached is not None
    return cached


def test_tenant_salt_and_chat_template_isolate_cached_blocks(
    slot_engine: SlotEngineFactory, smollm2_tokenizer: Any
) -> None:
    engine = slot_engine(num_device_blocks=200)
    long_text = {"prompt_token_ids": PROMPT}
    assert _cached_tokens(engine, long_text, tenant_salt=b"tenant-a") == 0
    assert _cached_tokens(engine, long_text, tenant_salt=b"tenant-a") == 28
    assert _cached_tokens(engine, long_text, tenant_salt=b"tenant-b") == 0
    assert _cached_tokens(engine, long_text) == 0

    messages = [{"role": "user", "content": "Tell me a long story about paged memory " * 3}]
    template = smollm2_tokenizer.chat_template
    same_text_other_template = template + "{# a different template renders the same text #}"
    assert (
        engine.renderer.render(messages).token_ids
        == engine.renderer.render(messages, chat_template=same_text_other_template).token_ids
    )
    assert _cached_tokens(engine, messages) == 0
    assert _cached_tokens(engine, messages) > 0
    assert _cached_tokens(engine, messages, chat_template=same_text_other_template) == 0
    assert_all_blocks_free(engine)


def test_adapter_identity_changes_the_hash_seed() -> None:
    base = CacheIdentity(model_weights_digest="w", tokenizer_digest="t")
    keys = CacheKeyFactory(base)
    plain = keys.key()
    adapter_a = keys.key(adapter_id="a", adapter_weights_digest="da")
    adapter_b = keys.key(adapter_id="b", adapter_weights_digest="da")
    adapter_a_new_weights = keys.key(adapter_id="a", adapter_weights_digest="db")
    seeds = {
        plain.hash_seed,
        adapter_a.hash_seed,
        adapter_b.hash_seed,
        adapter_a_new_weights.hash_seed,
    }
    assert len(seeds) == 4
    assert keys.key(adapter_id="a", adapter_weights_digest="da") == adapter_a

    manager = KVCacheManager(num_device_blocks=16, num_cpu_blocks=0, block_size=4)
    tokens = list(range(100, 113))
    for seq_id, key in enumerate((adapter_a, adapter_a, adapter_b, plain)):
        cached = manager.allocate(seq_id, tokens, CacheKey(key.hash_seed))
        assert cached == (12 if seq_id == 1 else 0)
        manager.mark_computed(seq_id, len(tokens))
        manager.free(seq_id)
