"""A guard for constrained decoding against a short token cycle repeating without end.

Inside an open JSON value a small model can fall into a cycle (`1.1.1.1...`, `aaaa...`) that
the grammar never ends, until `max_tokens`. When a constrained branch's last `CYCLE_TOKENS`
tokens are one cycle of at most `MAX_PERIOD` tokens (repeated at least 4 times), the token that
would continue it is masked for the next position, unless the grammar allows nothing else, so
the model takes the next most likely way on (most often the value's end). An output the guard
shapes is still one the grammar accepts; only a value that repeats one short cycle for 16 tokens
or more cannot be written.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

CYCLE_TOKENS = 16
"""How many of the last tokens must be one repeating cycle before the guard acts."""

MAX_PERIOD = 4
"""The longest cycle (in tokens) the guard looks for."""

HISTORY = max(CYCLE_TOKENS, 4 * MAX_PERIOD)
"""How many of a branch's last tokens the guard needs."""


def cycle_continuation(history: Sequence[int]) -> int | None:
    """The token that would continue a cycle filling the end of `history` (None: no cycle)."""
    for period in range(1, MAX_PERIOD + 1):
        span = max(CYCLE_TOKENS, 4 * period)
        if len(history) < span:
            return None
        tail = history[len(history) - span :]
        if all(tail[i] == tail[i - period] for i in range(period, span)):
            return tail[span - period]
    return None


def cut_cycles(masks: torch.Tensor, recent: Sequence[int], drafts: Sequence[int]) -> None:
    """Clears, in row i of the int32 token `masks`, the token continuing a cycle at the end of
    `recent` + the first i `drafts`, when the row allows another token."""
    for row in range(masks.shape[0]):
        history = [*recent, *drafts[:row]][-HISTORY:]
        token = cycle_continuation(history)
        if token is None:
            continue
        word, bit = divmod(token, 32)
        if word >= masks.shape[1]:
            continue
        before = int(masks[row, word]) & 0xFFFFFFFF
        after = before & ~(1 << bit)
        if after == before or (after == 0 and not bool((masks[row] != 0).sum() > 1)):
            continue  # not allowed anyway, or the only token the grammar allows
        masks[row, word] = after - (1 << 32) if after >= 1 << 31 else after
