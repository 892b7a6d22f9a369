"""The replica side of prefix-aware routing and of operator-shared prefixes.

`ReplicaBlocks` publishes the block hashes the replica's engine actually holds cached on the
device (`AsyncEngine.cached_block_hashes`, evictable blocks included), at most `capacity` of
them; Serve collects them through the replica's `record_routing_stats` (see
`cluster.serving.routing`).
It also knows the operator's shared prefixes (`ServeAppArgs.shared_prefixes`) as token ids and
says how many leading tokens of a prompt are one (`shared_prefix_tokens`), which every request
path passes to `AsyncEngine.generate`.

Invariants:
- a published hash is one the engine's block manager holds sealed at publication time (it may
  be evicted before the router uses it: that costs a recompute, never a wrong answer);
- `version` changes exactly when the published set does, so routers resync only then;
- a prompt's shared-prefix tokens are only leading tokens equal to an operator prefix's tokens,
  so no tenant's own text is ever cached unsalted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cluster.engine.async_engine import AsyncEngine
from cluster.engine.engine_core import PromptInput
from cluster.engine.errors import RequestRejected
from cluster.serving.prefix_index import BlockHasher, shared_prefix_blocks
from cluster.serving.routing import LoadReport, routing_stats


def shared_prefix_token_ids(engine: AsyncEngine, texts: Sequence[str]) -> list[tuple[int, ...]]:
    """Each operator prefix as it can begin a rendered prompt: tokenized as a text prompt is
    (the tokenizer's special tokens added) and as a rendered chat prompt is (none added)."""
    variants: list[tuple[int, ...]] = []
    for text in texts:
        for ids in (engine.encode(text), engine.tokenizer.encode(text, add_special_tokens=False)):
            if tuple(ids) not in variants:
                variants.append(tuple(ids))
    return variants


class ReplicaBlocks:
    """What one replica publishes to the routers, and how it keys prompts for its engine."""

    def __init__(
        self, engine: AsyncEngine, capacity: int, shared_prefixes: Sequence[str] = ()
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.engine = engine
        self.capacity = capacity
        self.shared_prefixes = tuple(shared_prefix_token_ids(engine, shared_prefixes))
        self.version = 0
        self._published: frozenset[bytes] = frozenset()

    def shared_prefix_tokens(self, prompt: PromptInput) -> int:
        """Leading tokens of `prompt` that are whole blocks of an operator-shared prefix (0 for
        a prompt the engine cannot render: it refuses that prompt itself)."""
        if not self.shared_prefixes:
            return 0
        try:
            ids = self.engine.prompt_token_ids(prompt)
        except RequestRejected:
            return 0
        block_size = self.engine.block_size
        return shared_prefix_blocks(ids, self.shared_prefixes, block_size) * block_size

    def hasher(self, tenant_salt: bytes | None) -> BlockHasher:
        """How a caller hashes a token-id prompt (no chat template) for this tenant."""
        key = self.engine.plain_cache_key(tenant_salt)
        return BlockHasher(
            key.hash_seed,
            tuple(bytes(k) for k in key.extra_keys),
            self.engine.block_size,
            self.shared_prefixes,
        )

    def hashes(self, prompt: PromptInput, tenant_salt: bytes | None) -> list[bytes]:
        """The prompt's cacheable block hashes as the engine keys them ([] if it cannot be
        rendered: the engine refuses it anyway)."""
        try:
            return self.engine.prompt_block_hashes(
                prompt,
                tenant_salt=tenant_salt,
                shared_prefix_tokens=self.shared_prefix_tokens(prompt),
            )
        except RequestRejected:
            return []

    def published(self) -> list[bytes]:
        """The cached block hashes to publish, least valuable first (the router's bounded index
        keeps the last ones longest): evictable blocks evicted soonest first, in-use ones last."""
        newest_last = self.engine.cached_block_hashes(self.capacity)[::-1]
        current = frozenset(newest_last)
        if current != self._published:
            self._published = current
            self.version += 1
        return newest_last

    def routing_stats(self) -> dict[str, Any]:
        hashes = self.published()
        return routing_stats(hashes, LoadReport.of(self.engine.metrics()), self.version)
