"""The contract between the engine and the workers: one `StepPlan` in, one `StepOutput` out.

The engine sends each tensor-parallel rank the same plan once per step. Plans carry only what
changed since the previous step: a sequence's block table travels as a splice (`table_start`,
`table_blocks`) and its sampling settings travel once, when the sequence is first scheduled; the
worker keeps both per sequence id until the sequence is released.

Invariants the engine guarantees (the workers rely on them, they do not re-derive them):
- no two sequences in one plan own the same KV slot for their new tokens;
- every block a sequence writes this step is held by that sequence alone (copy-on-write pairs
  that make it so are in `copy_pairs`);
- `start_pos` of a sequence equals the number of its tokens whose KV is already in the cache,
  so positions of the new tokens are `start_pos, start_pos + 1, ...`.

Order of execution on a worker: demotions (the CPU cache tier's device -> CPU copies of blocks the
plan reuses, before anything can overwrite them), swap-outs, then swap-ins and promotions, then
copies, then LoRA slot fills (`lora_drops`, `lora_loads`), then the forward pass
(which writes the new tokens' KV into their slots layer by layer before attending), then rank 0
samples. Swap-out sources may be handed to other sequences in the same plan, which is safe because
they are copied out before the forward pass writes anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

BlockPair = tuple[int, int]
"""A (source block id, destination block id) pair."""

PLACEHOLDER_TOKEN_ID = -1
"""The token id of a placeholder work until its executor fills it (outside every vocabulary, so
a plan run unfilled is refused rather than computed with a wrong token)."""


@dataclass(frozen=True)
class SamplingSettings:
    """How rank 0 turns a sequence's last logits into tokens.

    `temperature == 0` is greedy. `top_k <= 0` and `top_p >= 1` disable those filters. Sampling is
    stateless and reproducible: the random draw for a token uses a generator seeded from
    (`seed`, the branch index, the output index), so preemption by recompute, swaps or a different
    batch composition never change a seeded result. `logprobs` is the number of top alternatives
    to report beside the sampled token's own log-probability (None: report nothing).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    logprobs: int | None = None
    min_p: float = 0.0
    """Keep only tokens at least `min_p` times as likely as the most likely one (after the
    temperature); 0 disables it."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    """OpenAI's presence and frequency penalties (subtracted from the logits of tokens already in
    the output, once / once per occurrence) and the CTRL repetition penalty (a positive logit of
    a token already in the prompt or output divided by it, a negative one multiplied)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits before everything else but the grammar mask."""
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    """While fewer than `min_tokens` tokens are out, these (the request's stop token ids and, unless
    it ignores EOS, the model's EOS ids) cannot be drawn."""
    prompt_len: int = 0
    """The sequence's first `prompt_len` tokens are its prompt: the repetition penalty counts
    them, the presence and frequency penalties and the bad words read only the tokens after
    them."""
    allowed_token_ids: tuple[int, ...] = ()
    """When not empty, the only tokens that can be drawn (vLLM's `allowed_token_ids`)."""
    bad_words: tuple[tuple[int, ...], ...] = ()
    """Token sequences the output must not contain: a sequence's last token cannot be drawn
    right after the output's last tokens equal the rest of it (a one-token sequence never)."""
    prompt_logprobs: int | None = None
    """Prompt logprobs: how many top alternatives to report beside each prompt token's own
    log-probability (None: the rank computes none; see `SequenceWork.prompt_targets`)."""

    @property
    def penalizes(self) -> bool:
        """The repetition, frequency or presence penalty is on."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def needs_history(self) -> bool:
        """A penalty or a bad word of several tokens reads the sequence's earlier tokens (the
        rank keeps them, see `SequenceWork.history`)."""
        return self.penalizes or any(len(word) > 1 for word in self.bad_words)


@dataclass
class SequenceWork:
    """One sequence's share of a step: a prefill chunk (several tokens) or a decode (one token).

    The scheduler builds one per sequence per step with its fields by position (keyword
    arguments cost more than the rest of the construction): new fields go last."""

    seq_id: int
    token_ids: list[int]
    start_pos: int
    table_start: int = 0
    """The worker's cached block table is truncated to `table_start` entries, then extended."""
    table_blocks: list[int] = field(default_factory=list)
    num_samples: int = 0
    """Tokens to draw from the last position's logits: 0 for a non-final prefill chunk, 1 for a
    decode or final prefill chunk, n for the final prefill chunk of an n-way parallel request."""
    branch_index: int = 0
    """Branch of a parallel-sampling request; sample i of this entry uses branch_index + i."""
    output_index: int = 0
    """How many tokens this branch has generated before this step (seeds the draw)."""
    sampling: SamplingSettings | None = None
    """Sent when the sequence is first scheduled (or re-scheduled after release); else None."""
    lora_slot: int = -1
    """The device slot of this step's LoRA adapter for the sequence (-1: the base model). Sent
    every step: an adapter may move to another slot between steps."""
    num_draft_tokens: int = 0
    """Speculative decoding: the last `num_draft_tokens` of `token_ids` are drafts after the
    pending token (then `num_samples == 1`). Each of the `1 + num_draft_tokens` positions is
    computed as a decode of its own and draws one token, for output indexes `output_index`,
    `output_index + 1`, ...; the engine keeps those its drafts confirm."""
    token_bitmask: Any | None = None
    """Structured outputs: a `[positions, ceil(vocab / 32)]` int32 tensor, one row per position
    that draws (`1 + num_draft_tokens`), bit `t % 32` of word `t // 32` set when token `t` is
    allowed; rank 0 masks that row's logits before drawing. None: unconstrained."""
    placeholder: bool = False
    """Async scheduling: `token_ids` is one `PLACEHOLDER_TOKEN_ID`, to be replaced by the token
    this sequence sampled in the plan `StepPlan.placeholders_of` (see `workers.placeholders`)."""
    history: list[int] | None = None
    """Sent with `sampling` when its penalties read earlier tokens (`needs_history`): the
    sequence's tokens at positions `[0, start_pos)`. The rank then keeps every token it is fed,
    by position, so a draw at position p sees the tokens at `[0, p]`."""
    prompt_targets: list[int] | None = None
    """Prompt logprobs: the prompt's tokens at positions `start_pos + 1 ...` (at most one per
    token of `token_ids`); rank 0 returns the log-probability of each under the logits of the
    position before it, with `sampling.prompt_logprobs` top alternatives
    (`StepOutput.prompt_logprobs`)."""


@dataclass(frozen=True)
class LoRASlotLoad:
    """Fill device slot `slot` with the adapter of weights digest `digest` (from the rank's CPU
    memory, or read again from `path` when it was dropped there)."""

    slot: int
    digest: str
    path: str


@dataclass
class StepPlan:
    """Everything a worker rank needs for one engine step."""

    step_id: int
    sequences: list[SequenceWork] = field(default_factory=list)
    swap_out: list[BlockPair] = field(default_factory=list)
    """(device block, CPU block) pairs, all layers."""
    swap_in: list[BlockPair] = field(default_factory=list)
    """(CPU block, device block) pairs, all layers."""
    demote: list[BlockPair] = field(default_factory=list)
    """(device block, CPU block) pairs of the CPU cache tier, all layers, run first of all."""
    promote: list[BlockPair] = field(default_factory=list)
    """(CPU block, device block) pairs of CPU cache tier hits, all layers, run with swap_in."""
    copy_pairs: list[BlockPair] = field(default_factory=list)
    """(source device block, destination device block) pairs for copy-on-write, all layers."""
    forks: list[BlockPair] = field(default_factory=list)
    """(parent seq id, child seq id): the child starts with a copy of the parent's cached block
    table and sampling settings; applied before `sequences` are read."""
    released: list[int] = field(default_factory=list)
    """Sequence ids whose cached state the worker drops (finished, aborted, or preempted)."""
    lora_drops: list[str] = field(default_factory=list)
    """Digests of adapters the ranks drop from CPU memory (the engine's LRU evicted them)."""
    lora_loads: list[LoRASlotLoad] = field(default_factory=list)
    """Slot fills, applied after `lora_drops` and before the forward pass."""
    placeholders_of: int | None = None
    """The step id of the plan this one's placeholder works take their token from (the plan
    executed just before it); None: the plan has no placeholder."""


class PlanRejected(ValueError):
    """A rank refused a plan because of one of its sequences (`seq_ids`); it applied none of
    the plan. The engine fails the requests of those sequences and recomputes the step's
    others. Crosses Ray (a task error's cause) with `seq_ids` intact."""

    def __init__(self, message: str, seq_ids: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.seq_ids = tuple(seq_ids)

    def __reduce__(self) -> tuple[object, ...]:
        return (PlanRejected, (str(self), self.seq_ids))


@dataclass(frozen=True)
class SampledToken:
    """One drawn token, with log-probabilities when they were asked for."""

    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


@dataclass
class StepOutput:
    """What rank 0 returns: for every sequence with `num_samples > 0`, its drawn tokens in order
    (a speculative work's: one per position, `1 + num_draft_tokens`)."""

    step_id: int
    samples: dict[int, list[SampledToken]] = field(default_factory=dict)
    forward_seconds: float = 0.0
    corrupt_swap_ins: list[BlockPair] = field(default_factory=list)
    prompt_logprobs: dict[int, list[SampledToken]] = field(default_factory=dict)
    """For every sequence whose work carried `prompt_targets`: one entry per target, in order
    (`token_id` the target, `logprob` its log-probability, `top_logprobs` the alternatives)."""
    """(CPU block, device block) pairs of `swap_in` / `promote` whose CPU bytes failed their
    checksum (`verify_swaps`): the engine fails every sequence holding the device block."""
