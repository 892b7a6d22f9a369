"""Rank 0's logits processors: allowed token ids, logit bias, `min_tokens`' ban on stop tokens,
bad words, and the repetition, frequency and presence penalties, as vLLM applies them.

`penalized_logits` runs after the structured-outputs mask and before the greedy choice, the
temperature and the filters, in this order per row: the allowed-token mask, logit bias, the
stop-token and bad-word bans, the repetition penalty, then the frequency and presence penalties.

Invariants: a row whose settings ask for none of these is left exactly as it was (no copy when no
row asks); a row is a pure function of its logits, its settings, its output index and the
sequence's tokens before the drawing position, so batching, preemption and speculation change
nothing. A ban that would leave a row without any allowed token (a grammar that allows only
EOS before `min_tokens`, or only a bad word) is not applied: the grammar wins.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.plan import SamplingSettings


def processes(settings: SamplingSettings, output_index: int) -> bool:
    """Whether `penalized_logits` changes a row drawn with these settings at this output index."""
    return (
        bool(settings.logit_bias)
        or bool(settings.allowed_token_ids)
        or bool(settings.bad_words)
        or (output_index < settings.min_tokens and bool(settings.stop_token_ids))
        or settings.needs_history
    )


def penalized_logits(
    logits: torch.Tensor,
    rows: Sequence[tuple[SamplingSettings, int, Sequence[int] | None]],
) -> torch.Tensor:
    """`logits` (`[rows, vocab]`) with each row's processors applied: a copy when any row has
    one, else `logits` itself. `rows[i]` is row i's (settings, output index, tokens before the
    drawing position, None when the settings need none).

    Only the entries a processor names are read and written (gathered and scattered for all
    rows at once), so the cost follows the number of tokens involved, not rows x vocabulary."""
    changed = [i for i, (settings, index, _) in enumerate(rows) if processes(settings, index)]
    if not changed:
        return logits
    processed = logits.clone()
    vocab = processed.shape[-1]
    bias: list[tuple[int, int, float]] = []
    banned: list[tuple[int, int]] = []
    penalized = _PenalizedRows()
    repetition = torch.ones(len(rows))
    frequency = torch.zeros(len(rows))
    presence = torch.zeros(len(rows))
    for i in changed:
        settings, output_index, history = rows[i]
        if settings.needs_history and history is None:
            raise ValueError("penalties and bad words need the sequence's earlier tokens")
        if settings.allowed_token_ids:
            _keep_only(processed, i, settings.allowed_token_ids)
        bias.extend((i, token, value) for token, value in settings.logit_bias)
        if output_index < settings.min_tokens:
            banned.extend((i, t) for t in settings.stop_token_ids if 0 <= t < vocab)
        if settings.bad_words:
            ends = bad_word_ends(settings.bad_words, history or (), settings.prompt_len)
            banned.extend((i, t) for t in ends if t < vocab)
        if settings.penalizes:
            assert history is not None
            repetition[i] = settings.repetition_penalty
            frequency[i] = settings.frequency_penalty
            presence[i] = settings.presence_penalty
            penalized.add(i, history, settings.prompt_len)
    flat = processed.view(-1)
    if bias:
        where = torch.tensor([i * vocab + token for i, token, _ in bias])
        flat.index_add_(0, where, torch.tensor([value for _, _, value in bias]))
    if banned:
        _ban(processed, banned)
    if penalized.rows:
        seen, counted = penalized.flat_indices(vocab)
        where = torch.unique(seen)
        values = flat[where]
        penalty = repetition[where // vocab]
        flat[where] = torch.where(values > 0, values / penalty, values * penalty)
        where, counts = torch.unique(counted, return_counts=True)
        row = where // vocab
        flat[where] -= frequency[row] * counts.to(flat.dtype) + presence[row]
    return processed


class _PenalizedRows:
    """The earlier tokens of the penalized rows, gathered into one tensor (one conversion from
    Python ints for the whole batch, not one per row)."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.lengths: list[int] = []
        self.prompt_lens: list[int] = []
        self.tokens: list[int] = []

    def add(self, row: int, history: Sequence[int], prompt_len: int) -> None:
        self.rows.append(row)
        self.lengths.append(len(history))
        self.prompt_lens.append(prompt_len)
        self.tokens.extend(history)

    def flat_indices(self, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices into the flattened logits of every earlier token (what the repetition
        penalty reads) and of the output tokens among them (the frequency and presence
        penalties: positions at or after each row's prompt)."""
        lengths = torch.tensor(self.lengths)
        row = torch.repeat_interleave(torch.tensor(self.rows), lengths)
        seen = torch.tensor(self.tokens, dtype=torch.int64) + row * vocab
        starts = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
        position = torch.arange(len(self.tokens)) - starts
        counted = seen[position >= torch.repeat_interleave(torch.tensor(self.prompt_lens), lengths)]
        return seen, counted


def _ban(processed: torch.Tensor, banned: list[tuple[int, int]]) -> None:
    """Set the (row, token) entries to -inf, except in a row that would be left with nothing
    allowed (a grammar that allows only a stop token): the grammar wins there."""
    for i in sorted({i for i, _ in banned}):
        tokens = torch.tensor([t for r, t in banned if r == i])
        kept = processed[i].clone()
        kept[tokens] = float("-inf")
        if bool(torch.isfinite(kept).any()):
            processed[i] = kept


def bad_word_ends(
    bad_words: Sequence[Sequence[int]], history: Sequence[int], prompt_len: int
) -> list[int]:
    """The tokens that would complete one of `bad_words` after the output so far (`history`
    past its first `prompt_len` tokens): a word's last token when the output ends with the rest
    of it (always, for a word of one token). Reads only the output's last tokens, not a copy of
    it."""
    outputs = len(history) - prompt_len
    ends = []
    for word in bad_words:
        prefix = len(word) - 1
        if prefix == 0 or (
            outputs >= prefix and list(history[len(history) - prefix :]) == list(word[:-1])
        ):
            ends.append(word[-1])
    return ends


def _keep_only(processed: torch.Tensor, row: int, allowed: Sequence[int]) -> None:
    """Row `row` keeps its logits at `allowed` (ids inside the vocabulary) and -inf elsewhere."""
    ids = torch.tensor([t for t in allowed if 0 <= t < processed.shape[-1]], dtype=torch.int64)
    kept = processed[row, ids]
    processed[row].fill_(float("-inf"))
    processed[row, ids] = kept
