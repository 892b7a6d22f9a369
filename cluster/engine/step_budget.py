"""The token budget of one scheduler step, shared by decodes, drafts and prompt chunks, and the
prefill cap that holds while decodes run."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from block_manager import KVManager
    from cluster.engine.request import Request


class StepBudget:
    """The step's remaining token budget; chunks of more than one token (prefill) also draw on
    `prefill` when it is capped (decodes running), single tokens (decodes) only on `tokens`."""

    def __init__(self, tokens: int, prefill: int | None = None) -> None:
        self.tokens = tokens
        self.prefill = prefill

    def room(self, wanted: int) -> int:
        """How many tokens a chunk of `wanted` tokens could take now."""
        if wanted > 1 and self.prefill is not None:
            return min(self.tokens, self.prefill)
        return self.tokens

    def take(self, wanted: int) -> int:
        granted = min(wanted, self.room(wanted))
        self.tokens -= granted
        if wanted > 1 and self.prefill is not None:
            self.prefill -= granted
        return granted

    def take_drafts(self, count: int) -> None:
        """Speculative rows of a decode: they draw on `tokens` only (they are not prompt)."""
        if count > self.tokens:
            raise ValueError(f"{count} drafts exceed the {self.tokens} tokens left in the step")
        self.tokens -= count


def prefill_cap(cap: int | None, running: Iterable[Request], bm: KVManager) -> int | None:
    """`cap` (`max_prefill_tokens`) while a running sequence is decoding (its prompt computed),
    so prompt chunks cannot stretch the steps that decodes wait on; None (no cap) otherwise."""
    if cap is None:
        return None
    for request in running:
        prompt_len = len(request.prompt_token_ids)
        for branch in request.active_branches:
            if (
                bm.has_sequence(branch.seq_id)
                and bm.num_computed_tokens(branch.seq_id) >= prompt_len
            ):
                return cap
    return None
