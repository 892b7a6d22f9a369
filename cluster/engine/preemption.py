"""Recompute or swap for a preempted request: `choose_swap`, and the cost model it asks in
`auto` mode.

Recompute costs the forward passes of every token the request will prefill again; swap costs
moving its KV blocks to the CPU tier and back. Both are estimated in seconds: the per-token
compute time is learned from the steps the engine runs (an exponential moving average of
forward seconds per scheduled token), the copy bandwidth is a setting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from block_manager import KVManager
    from cluster.engine.request import Request


@dataclass
class PreemptionCostModel:
    """Estimates both costs; `prefer_swap` compares them."""

    kv_bytes_per_block: int
    swap_bytes_per_second: float = 4e9
    seconds_per_token: float = 1e-3
    smoothing: float = 0.2

    def observe_step(self, forward_seconds: float, num_tokens: int) -> None:
        """Learn the compute cost per token from a finished step."""
        if num_tokens <= 0 or forward_seconds <= 0:
            return
        sample = forward_seconds / num_tokens
        self.seconds_per_token += self.smoothing * (sample - self.seconds_per_token)

    def recompute_seconds(self, tokens_to_recompute: int) -> float:
        return tokens_to_recompute * self.seconds_per_token

    def swap_seconds(self, num_blocks: int) -> float:
        """Out now and back in later: the blocks cross the link twice."""
        return 2 * num_blocks * self.kv_bytes_per_block / self.swap_bytes_per_second

    def prefer_swap(self, *, tokens_to_recompute: int, num_blocks: int) -> bool:
        return self.swap_seconds(num_blocks) < self.recompute_seconds(tokens_to_recompute)

    def promotion_crossover_seconds_per_token(self, block_size: int) -> float:
        """The compute cost per token above which copying a CPU-tier hit back (one crossing:
        it was demoted already) beats recomputing it; both costs grow with the block count, so
        the choice is the same for any number of blocks."""
        return self.kv_bytes_per_block / self.swap_bytes_per_second / block_size

    def prefer_promote(self, block_size: int) -> bool:
        """Whether a CPU-tier hit is promoted rather than recomputed, at the learned cost."""
        return self.seconds_per_token > self.promotion_crossover_seconds_per_token(block_size)


def choose_swap(
    mode: str,
    bm: KVManager,
    cost_model: PreemptionCostModel,
    request: Request,
    seq_ids: list[int],
) -> bool:
    """Whether to swap `request` out (else it is recomputed), `mode` being the scheduler's
    `preemption_mode`. Swap only fully computed sequences (a half-done prompt has little KV
    worth keeping) and only when the CPU tier has room; in `auto` the cost model decides."""
    if mode == "recompute" or not seq_ids or bm.num_cpu_blocks == 0:
        return False
    prefilling = any(bm.num_tokens(s) - bm.num_computed_tokens(s) > 1 for s in seq_ids)
    if prefilling or not bm.can_swap_out(seq_ids):
        return False
    if mode == "swap":
        return True
    tokens = len(request.prompt_token_ids) + sum(
        len(b.output_token_ids) for b in request.active_branches
    )
    blocks = len({blk for s in seq_ids for blk in bm.block_table(s)})
    return cost_model.prefer_swap(tokens_to_recompute=tokens, num_blocks=blocks)
