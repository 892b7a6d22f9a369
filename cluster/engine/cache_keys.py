"""Per-request cache keys: the identity digest that seeds a request's block hashes, plus salts.

Requests share cached KV blocks only when everything that shaped those blocks is the same: model
weights, tokenizer, the chat template that rendered the prompt, the adapter, and the KV-relevant
execution settings (all in `CacheIdentity`), and the tenant salt (an extra key of every block
but those of an operator-shared prefix, see `unsalted_blocks`).
"""

from __future__ import annotations

import dataclasses
import os

from block_manager import CacheIdentity, CacheKey, prompt_block_hashes
from cluster.engine.errors import AdapterNotFound, RequestRejected
from cluster.engine.generate_request import GenerateRequest
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
        extra: tuple[bytes, ...] = ()
        if adapter_weights_digest is not None:
            extra += (b"lora:" + adapter_weights_digest.encode(),)
        if tenant_salt:
            extra += (b"tenant:" + tenant_salt,)
        return CacheKey(hash_seed=seed, extra_keys=extra, unsalted_blocks=unsalted_blocks)


class RequestKeys:
    """The cache key and cacheable block hashes of a `GenerateRequest`, exactly as the engine's
    block manager keys its blocks. Picklable: an ingress holds a copy to hash prompts for
    routing without asking an engine."""

    LORA_KIND = "lora"
    """`CacheIdentity.adapter_id` of every adapter: the name never enters a key."""

    def __init__(self, factory: CacheKeyFactory, block_size: int) -> None:
        self.factory = factory
        self.block_size = block_size
        self.adapters: dict[str, str] = {}
        """Adapter name -> weights digest, as the engine serves them (its `LoRAManager`'s map:
        a copy held elsewhere must be refreshed when adapters are added or removed)."""

    def key_for(self, request: GenerateRequest) -> CacheKey:
        """Its template's identity seed, the tenant salt, and `shared_prefix_tokens //
        block_size` leading unsalted blocks. Raises RequestRejected for a shared prefix that is
        not an int within the prompt; AdapterNotFound for an adapter name not served.

        An adapter's weights digest (never its name or path) is in the identity that seeds the
        chain and in every salted block's extra keys, so the same prompt under two adapters
        shares no block and the same weights under two names share every block.

        A request that asks for prompt logprobs needs every prompt position computed, so its
        key is salted with a fresh random nonce: none of its blocks is ever a cache hit (its
        own, after a preemption, included)."""
        shared = request.shared_prefix_tokens
        num_prompt_tokens = request.num_prompt_tokens
        valid = isinstance(shared, int) and not isinstance(shared, bool)
        if not valid or not 0 <= shared <= num_prompt_tokens:
            raise RequestRejected(
                f"shared_prefix_tokens must be an int in [0, {num_prompt_tokens}] (the prompt's "
                f"length), got {shared!r}"
            )
        digest = None
        if request.adapter is not None:
            digest = self.adapters.get(request.adapter)
            if digest is None:
                raise AdapterNotFound(f"adapter {request.adapter!r} is not loaded")
        salt = request.tenant_salt
        uncached = request.params.prompt_logprobs is not None
        if uncached:
            salt = (salt or b"") + b"\x00prompt-logprobs\x00" + os.urandom(16)
        return self.factory.key(
            chat_template_digest=request.prompt.chat_template_digest,
            adapter_id=None if digest is None else self.LORA_KIND,
            adapter_weights_digest=digest,
            tenant_salt=salt,
            unsalted_blocks=0 if uncached else shared // self.block_size,
        )

    def block_hashes(self, request: GenerateRequest) -> list[bytes]:
        """Chain hashes of the request's blocks a prefix lookup could hit (its full blocks but
        the one holding the last token)."""
        return prompt_block_hashes(request.token_ids, self.key_for(request), self.block_size)
