"""Shared builders for the block manager tests."""

from __future__ import annotations

from dataclasses import dataclass

from block_manager import CacheIdentity, CacheKey, KVCacheManager

IDENTITY = CacheIdentity(model_weights_digest="sha256:weights-v1", tokenizer_digest="sha256:tok-v1")
SEED = IDENTITY.digest()
OTHER_SEED = CacheIdentity(
    model_weights_digest="sha256:weights-v2", tokenizer_digest="sha256:tok-v1"
).digest()


def make_manager(
    *,
    device: int = 16,
    cpu: int = 8,
    block_size: int = 4,
    caching: bool = True,
    watermark: int = 0,
) -> KVCacheManager:
    return KVCacheManager(
        num_device_blocks=device,
        num_cpu_blocks=cpu,
        block_size=block_size,
        enable_prefix_caching=caching,
        watermark_blocks=watermark,
    )


def prefill(
    manager: KVCacheManager,
    seq_id: int,
    tokens: list[int],
    *,
    seed: bytes = SEED,
    extra_keys: tuple[str, ...] = (),
) -> int:
    """Allocate and compute a whole prompt, as the engine does for a prefill; returns hits."""
    cached = manager.allocate(seq_id, tokens, CacheKey(seed, extra_keys))
    manager.mark_computed(seq_id, len(tokens))
    return cached


@dataclass(frozen=True)
class Observation:
    """Everything a failed operation must leave unchanged, read through the public API."""

    sequences: tuple[tuple[int, int, int, bool, tuple[int, ...] | None], ...]
    free_device: int
    pressure: object


def observe(manager: KVCacheManager, seq_ids: list[int]) -> Observation:
    rows = []
    for seq_id in sorted(seq_ids):
        if not manager.has_sequence(seq_id):
            continue
        swapped = manager.is_swapped(seq_id)
        table = None if swapped else tuple(manager.block_table(seq_id))
        rows.append(
            (
                seq_id,
                manager.num_tokens(seq_id),
                manager.num_computed_tokens(seq_id),
                swapped,
                table,
            )
        )
    return Observation(tuple(rows), manager.num_free_device_blocks(), manager.pressure())
