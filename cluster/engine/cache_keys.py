"""Per-request cache keys: the identity digest that seeds a request's block hashes, plus salts.

Requests share cached KV blocks only when everything that shaped those blocks is the same: model
weights, tokenizer, the chat template that rendered the prompt, the adapter, and the KV-relevant
execution settings (all in `CacheIdentity`), and the tenant salt (an extra key of every block
but those of an operator-shared prefix, see `unsalted_blocks`).
"""

from __future__ import annotations

import dataclasses

from block_manager import CacheIdentity, CacheKey
from cluster.engine.tokenization import NO_TEMPLATE


class CacheKeyFactory:
    """Builds `CacheKey`s from one engine-wide base identity; digests are memoized."""

    def __init__(self, base: CacheIdentity) -> None:
        self.base = base
        self._seeds: dict[tuple[str, str | None, str | None], bytes] = {}

    def key(
        self,
        *,
        chat_template_digest: str = NO_TEMPLATE,
        adapter_id: str | None = None,
        adapter_weights_digest: str | None = None,
        tenant_salt: bytes | None = None,
        unsalted_blocks: int = 0,
    ) -> CacheKey:
        """`unsalted_blocks` leading full blocks are hashed without the tenant salt (shared)."""
        memo = (chat_template_digest, adapter_id, adapter_weights_digest)
        seed = self._seeds.get(memo)
        if seed is None:
            identity = dataclasses.replace(
                self.base,
                chat_template_digest=chat_template_digest,
                adapter_id=adapter_id,
                adapter_weights_digest=adapter_weights_digest,
            )
            seed = identity.digest()
            self._seeds[memo] = seed
        extra = (b"tenant:" + tenant_salt,) if tenant_salt else ()
        return CacheKey(hash_seed=seed, extra_keys=extra, unsalted_blocks=unsalted_blocks)
