"""An operator-shared prefix through the engine (over `SlotWorkers`): tenants share its whole
blocks and nothing after it, outputs stay exactly the unpaged reference, and the engine's
`RequestKeys.block_hashes` name exactly the blocks its block manager caches."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.engine.errors import RequestRejected
from cluster.engine.sampling_params import SamplingParams
from tests.engine.conftest import SlotEngineFactory
from tests.engine.slot_workers import reference_tokens
from tests.engine.test_paging_slot_model import assert_all_blocks_free

SYSTEM = list(range(500, 514))  # 14 tokens: 3 whole blocks of 4 shared, 2 tokens in block 3
QUESTION_A = list(range(600, 611))
QUESTION_B = list(range(700, 711))
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ALICE, BOB = b"alice-salt", b"bob-salt"


def run(engine: Any, prompt: list[int], salt: bytes | None, shared: int) -> int:
    """Runs one request to the end; checks its tokens against the unpaged reference and
    returns the tokens it found cached."""
    request = engine.add_request(
        engine.request_builder.build(
            {"prompt_token_ids": prompt}, PARAMS, tenant_salt=salt, shared_prefix_tokens=shared
        )
    )
    final = None
    while engine.has_unfinished():
        for output in engine.step():
            if output.request_id == request.request_id and output.finished:
                final = output
    assert final is not None and final.error is None
    expected = reference_tokens(
        prompt,
        request.settings,
        branch_index=0,
        max_tokens=PARAMS.max_tokens or 0,
        ignore_eos=True,
    )
    assert final.outputs[0].token_ids == expected
    return final.num_cached_tokens


def test_tenants_share_the_system_prompt_blocks_and_nothing_after(
    slot_engine: SlotEngineFactory,
) -> None:
    engine = slot_engine(num_device_blocks=200)
    shared = len(SYSTEM)
    whole = (shared // 4) * 4
    assert run(engine, SYSTEM + QUESTION_A, ALICE, shared) == 0
    assert run(engine, SYSTEM + QUESTION_B, BOB, shared) == whole
    # Bob sending Alice's very prompt still stops at the shared prefix: her question is salted.
    assert run(engine, SYSTEM + QUESTION_A, BOB, shared) == whole
    # Alice gets her own blocks back beyond the prefix (all full blocks but the last token's).
    prompt = SYSTEM + QUESTION_A
    assert run(engine, prompt, ALICE, shared) == ((len(prompt) - 1) // 4) * 4
    # Without the operator's declaration a third tenant shares nothing.
    assert run(engine, SYSTEM + QUESTION_A, b"carol-salt", 0) == 0
    assert_all_blocks_free(engine)


def test_prompt_block_hashes_are_the_blocks_the_manager_caches(
    slot_engine: SlotEngineFactory,
) -> None:
    engine = slot_engine(num_device_blocks=200)
    prompt = {"prompt_token_ids": SYSTEM + QUESTION_A}
    shared = len(SYSTEM)
    build = engine.request_builder.build
    alice = engine.request_keys.block_hashes(
        build(prompt, PARAMS, tenant_salt=ALICE, shared_prefix_tokens=shared)
    )
    bob = engine.request_keys.block_hashes(
        build(prompt, PARAMS, tenant_salt=BOB, shared_prefix_tokens=shared)
    )
    assert len(alice) == (len(SYSTEM + QUESTION_A) - 1) // 4
    assert alice[:3] == bob[:3] and not set(alice[3:]) & set(bob[3:])
    assert not set(alice) & set(engine.block_manager.cached_block_hashes())
    run(engine, SYSTEM + QUESTION_A, ALICE, shared)
    cached = list(engine.block_manager.cached_block_hashes())
    assert len(cached) == len(set(cached))
    assert set(alice) <= set(cached)  # evictable blocks are listed too
    assert not set(bob[3:]) & set(cached)
    unshared = engine.request_keys.block_hashes(build(prompt, PARAMS, tenant_salt=ALICE))
    assert unshared[0] != alice[0] and not set(unshared) & set(cached)


@pytest.mark.parametrize("shared", [-1, 26, True, 2.0, "3"])
def test_bad_shared_prefix_tokens_are_rejected(slot_engine: SlotEngineFactory, shared: Any) -> None:
    engine = slot_engine()
    with pytest.raises(RequestRejected, match="shared_prefix_tokens"):
        engine.add_request(
            engine.request_builder.build(
                {"prompt_token_ids": SYSTEM + QUESTION_A}, PARAMS, shared_prefix_tokens=shared
            )
        )
    assert not engine.has_unfinished() and not engine.requests
