"""An operator-declared shared system prompt over HTTP: two tenants hit each other's KV blocks
for the whole blocks of that prompt, and never for anything after it.

The expected count is computed here from the HF tokenizer: the leading tokens of the prompt that
equal the shared prefix's tokens, rounded down to whole blocks of the session app (4 tokens)."""

from __future__ import annotations

import httpx

from tests.serving.conftest import MODEL, SHARED_SYSTEM_PROMPT, GreedyOracle, Served

BLOCK_SIZE = 4


def cached_tokens(served: Served, key: str, prompt: str) -> int:
    response = httpx.post(
        f"{served.http_base}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def shared_whole_blocks(oracle: GreedyOracle, prompt: str) -> int:
    ids = oracle.tokenizer.encode(prompt, add_special_tokens=True)
    best = 0
    for shared in (
        oracle.tokenizer.encode(SHARED_SYSTEM_PROMPT, add_special_tokens=True),
        oracle.tokenizer.encode(SHARED_SYSTEM_PROMPT, add_special_tokens=False),
    ):
        common = 0
        while common < min(len(ids), len(shared)) and ids[common] == shared[common]:
            common += 1
        best = max(best, common)
    return best // BLOCK_SIZE * BLOCK_SIZE


def test_tenants_share_the_declared_system_prompt_and_nothing_after(
    served: Served, oracle: GreedyOracle
) -> None:
    alice_prompt = SHARED_SYSTEM_PROMPT + "Alice asks how copy on write works for forked tails?"
    bob_prompt = SHARED_SYSTEM_PROMPT + "Bob wonders why swapping blocks to the host helps?"
    shared = shared_whole_blocks(oracle, alice_prompt)
    assert shared == shared_whole_blocks(oracle, bob_prompt) >= 3 * BLOCK_SIZE
    alice_len = len(oracle.tokenizer.encode(alice_prompt, add_special_tokens=True))
    alice_full = (alice_len - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert alice_full > shared  # Alice's question fills blocks of its own

    assert cached_tokens(served, "key-alice", alice_prompt) == 0  # first time anyone sends it
    assert cached_tokens(served, "key-bob", bob_prompt) == shared  # Alice's system blocks
    # Bob sending Alice's exact prompt stops at the shared prefix: her question is salted.
    assert cached_tokens(served, "key-bob", alice_prompt) == shared
    # Alice (another key of hers too) finds all her own full blocks.
    assert cached_tokens(served, "key-alice-2", alice_prompt) == alice_full
    served.wait_until_idle()
