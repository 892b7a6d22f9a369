"""The replica side of prefix-aware routing: hash what the engine computes and publish it.

`ReplicaBlocks` hashes every prompt the replica's engine admits exactly as the engine's block
manager does (the engine's renderer and cache-key factory give the token ids, the
`CacheIdentity` seed and the tenant extra keys) and keeps the newest `capacity` hashes; Serve
collects them through the replica's `record_routing_stats` (see `cluster.routing`).

Invariant: a published hash is one the engine computed a block for; the record is bounded and
approximate in one direction only: a block the engine has since evicted may still be listed
until newer ones push it out (the router then finds a shorter prefix than advertised, which costs
a recompute, never a wrong answer).
"""

from __future__ import annotations

from typing import Any

from cluster.engine import AsyncEngine
from cluster.engine_core import PromptInput
from cluster.errors import RequestRejected
from cluster.prefix_index import BlockHasher, PublishedBlocks, prompt_block_hashes
from cluster.routing import LoadReport, routing_stats


class ReplicaBlocks:
    """Block hashes of the prompts one replica's engine admitted, newest last."""

    def __init__(self, engine: AsyncEngine, capacity: int) -> None:
        self.engine = engine
        self.published = PublishedBlocks(capacity)
        self.version = 0

    @property
    def block_size(self) -> int:
        return self.engine.core.config.cache.block_size

    def hasher(self, tenant_salt: bytes | None) -> BlockHasher:
        """How a caller hashes a text or token-id prompt (no chat template) for this tenant."""
        key = self.engine.core.cache_keys.key(tenant_salt=tenant_salt)
        return BlockHasher(key.hash_seed, tuple(bytes(k) for k in key.extra_keys), self.block_size)

    def hashes(self, prompt: PromptInput, tenant_salt: bytes | None) -> list[bytes]:
        """The prompt's cacheable block hashes as the engine computes them ([] if it cannot be
        rendered: the engine refuses it anyway)."""
        core = self.engine.core
        try:
            rendered = core.renderer.render(prompt)
        except RequestRejected:
            return []
        key = core.cache_keys.key(
            chat_template_digest=rendered.chat_template_digest, tenant_salt=tenant_salt
        )
        return prompt_block_hashes(
            rendered.token_ids,
            hash_seed=key.hash_seed,
            extra_keys=key.extra_keys,
            block_size=self.block_size,
        )

    def observe(self, prompt: PromptInput, tenant_salt: bytes | None) -> None:
        """Records an admitted prompt's blocks."""
        hashes = self.hashes(prompt, tenant_salt)
        if hashes:
            self.published.add(hashes)
            self.version += 1

    def routing_stats(self) -> dict[str, Any]:
        return routing_stats(self.published, LoadReport.of(self.engine.metrics()), self.version)
