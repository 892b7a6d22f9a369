"""Rank 0's sampler: greedy, temperature, min-p, top-k, top-p, stateless seeds, log-probabilities.

Invariant: a draw depends only on the logits row and (worker seed, request seed, branch index,
output index), never on the batch or on earlier draws, so recompute, swaps and different batch
compositions reproduce a seeded result. Draws run on CPU in float32 with a fresh
`torch.Generator` per token. Reported log-probabilities are those of the model's own
distribution (log-softmax of the raw logits, before temperature and filters), restricted to
the allowed tokens when a structured-outputs bitmask comes with the row (only that row is
masked; every other row of the batch is sampled exactly as without it). Logit bias,
`min_tokens` and the penalties (`workers.penalties`) change what is drawn, greedy included, but
not the reported log-probabilities, as in vLLM.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import torch

from workers.penalties import penalized_logits
from workers.plan import SampledToken, SamplingSettings


@dataclass(frozen=True)
class SampleRequest:
    """Draw `num_samples` tokens from one logits row; sample i uses branch `branch_index + i`."""

    settings: SamplingSettings
    num_samples: int
    branch_index: int
    output_index: int
    token_bitmask: torch.Tensor | None = None
    """`[ceil(vocab / 32)]` int32, bit set: token allowed (see `SequenceWork.token_bitmask`)."""
    history: list[int] | None = None
    """The sequence's tokens at positions up to the drawing one, when the penalties need them."""


def draw_seed(worker_seed: int, request_seed: int, branch: int, output_index: int) -> int:
    """A 63-bit generator seed that is a pure function of its four arguments."""
    text = f"{worker_seed}:{request_seed}:{branch}:{output_index}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


NUCLEUS_FIRST_K = 64
"""Top-p looks for its nucleus among the `NUCLEUS_FIRST_K` most likely tokens first, then 4x as
many until their mass reaches `top_p` (a full sort of a 49k vocabulary takes ~3 ms on CPU, a
top-64 ~0.1 ms, and a nucleus is usually small)."""


def candidates(
    logits: torch.Tensor, settings: SamplingSettings
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The tokens a draw may pick and their probabilities (summing to 1): softmax of
    logits/temperature restricted to the min-p and top-k tokens, then the top-p nucleus.

    Min-p keeps the tokens at least `min_p` times as likely as the most likely one. Top-p keeps
    the smallest prefix of the descending-probability tokens whose mass reaches `top_p` (always
    at least the most likely token). Token ids are None when the probabilities are over the
    whole vocabulary in order (no top-p)."""
    scaled = logits / settings.temperature
    if settings.min_p > 0.0:
        floor = scaled.max() + math.log(settings.min_p)
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    if 0 < settings.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, settings.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if settings.top_p >= 1.0:
        return None, probs
    vocab = probs.shape[-1]
    k = NUCLEUS_FIRST_K
    while True:
        if k >= vocab:
            values, ids = torch.sort(probs, descending=True)
        else:
            values, ids = torch.topk(probs, k)
        mass = torch.cumsum(values, dim=-1)
        if k >= vocab or mass[-1] >= settings.top_p:
            break
        k *= 4
    kept = (mass - values) < settings.top_p
    values = values[kept]
    return ids[kept], values / values.sum()


def filtered_probabilities(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """`candidates` as probabilities over the whole vocabulary (zero where not kept)."""
    ids, probs = candidates(logits, settings)
    if ids is None:
        return probs
    return torch.zeros_like(logits).scatter_(-1, ids, probs)


def draw(ids: torch.Tensor | None, probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from `candidates`' (ids, probabilities) by inverse transform sampling: a
    uniform number from `generator` against the cumulative mass (in float64). The first token
    whose cumulative mass exceeds it is drawn, so a token of probability 0 never is.
    `torch.multinomial` draws from the same distribution about 15x slower on CPU."""
    cumulative = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    total = float(cumulative[-1])
    if not total > 0.0:  # also NaN: every token was masked out
        raise ValueError("no token can be drawn: every token has probability 0")
    uniform = float(torch.rand(1, generator=generator, dtype=torch.float64))
    target = torch.tensor([uniform * total], dtype=torch.float64)
    index = int(torch.searchsorted(cumulative, target, right=True))
    if index >= probs.shape[-1]:  # rounding put the target at the very end
        index = int(torch.nonzero(probs).max())
    return index if ids is None else int(ids[index])


def mask_disallowed(row: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`row` with every token the bitmask does not allow set to -inf (a new tensor); tokens
    beyond the bitmask's bits are disallowed."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.to(torch.int32).unsqueeze(-1) >> shifts) & 1
    allowed = bits.reshape(-1).bool()
    vocab = row.shape[-1]
    if allowed.numel() < vocab:
        allowed = torch.cat([allowed, allowed.new_zeros(vocab - allowed.numel())])
    return row.masked_fill(~allowed[:vocab], float("-inf"))


def apply_token_bitmasks(logits: torch.Tensor, requests: list[SampleRequest]) -> torch.Tensor:
    """`logits` (`[rows, vocab]`) with each request's bitmask applied to its own row: a copy when
    any row has one (the rows without are copied unchanged), else `logits` itself. One batched
    call of xgrammar's CPU kernel; `mask_disallowed` row by row where xgrammar is missing."""
    rows = [i for i, request in enumerate(requests) if request.token_bitmask is not None]
    if not rows:
        return logits
    masked = logits.clone()
    try:
        from xgrammar import apply_token_bitmask_inplace
    except ImportError:  # pragma: no cover - xgrammar is a dependency
        for i in rows:
            bitmask = requests[i].token_bitmask
            assert bitmask is not None
            masked[i] = mask_disallowed(masked[i], bitmask)
        return masked
    words = max(int(requests[i].token_bitmask.shape[-1]) for i in rows)  # type: ignore[union-attr]
    bitmasks = torch.full((len(requests), words), -1, dtype=torch.int32)
    for i in rows:
        bitmask = requests[i].token_bitmask
        assert bitmask is not None
        bitmasks[i, : bitmask.shape[-1]] = bitmask.to(torch.int32)
        bitmasks[i, bitmask.shape[-1] :] = 0
    vocab = min(masked.shape[-1], words * 32)
    apply_token_bitmask_inplace(masked, bitmasks, vocab_size=vocab, indices=rows)
    if masked.shape[-1] > vocab:  # tokens beyond the bitmask's bits are disallowed
        masked[rows, vocab:] = float("-inf")
    return masked


def check_settings(settings: SamplingSettings) -> None:
    """Raise a ValueError naming the first out-of-range sampling setting."""
    if settings.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {settings.temperature}")
    if settings.top_p <= 0.0:
        raise ValueError(f"top_p must be > 0, got {settings.top_p}")
    if settings.logprobs is not None and settings.logprobs < 0:
        raise ValueError(f"logprobs must be >= 0 when given, got {settings.logprobs}")
    if not 0.0 <= settings.min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {settings.min_p}")
    if not settings.repetition_penalty > 0.0:
        raise ValueError(f"repetition_penalty must be > 0, got {settings.repetition_penalty}")
    if settings.min_tokens < 0:
        raise ValueError(f"min_tokens must be >= 0, got {settings.min_tokens}")
    if settings.prompt_len < 0:
        raise ValueError(f"prompt_len must be >= 0, got {settings.prompt_len}")
    if any(token < 0 for token in settings.allowed_token_ids):
        raise ValueError(f"allowed_token_ids must be >= 0, got {settings.allowed_token_ids}")
    if any(not word or min(word) < 0 for word in settings.bad_words):
        raise ValueError(f"bad_words must be non-empty token ids >= 0, got {settings.bad_words}")
    for name, value in (
        ("presence_penalty", settings.presence_penalty),
        ("frequency_penalty", settings.frequency_penalty),
    ):
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value}")


def sample_rows(
    logits: torch.Tensor, requests: list[SampleRequest], worker_seed: int
) -> list[list[SampledToken]]:
    """One list of drawn tokens per request; `logits` is `[len(requests), vocab]` float32."""
    logits = apply_token_bitmasks(logits.to(device="cpu", dtype=torch.float32), requests)
    processed = penalized_logits(
        logits, [(request.settings, request.output_index, request.history) for request in requests]
    )
    # Every greedy row's token from one reduction over the batch: the first maximal index, as
    # `torch.argmax` gives, but `torch.max`'s reduction finds it 2.6x faster on CPU (64 rows of
    # a 49k vocabulary: 1.06 ms against 2.79, about 2 % of an AMX decode step).
    greedy = (
        torch.max(processed, dim=-1).indices.tolist()
        if any(request.settings.temperature == 0 for request in requests)
        else []
    )
    results: list[list[SampledToken]] = []
    for index, request in enumerate(requests):
        settings = request.settings
        check_settings(settings)
        logprobs = (
            torch.log_softmax(logits[index], dim=-1) if settings.logprobs is not None else None
        )
        kept = None if settings.temperature == 0 else candidates(processed[index], settings)
        tokens: list[SampledToken] = []
        for i in range(request.num_samples):
            if kept is None:
                token = greedy[index]
            else:
                generator = torch.Generator().manual_seed(
                    draw_seed(
                        worker_seed, settings.seed, request.branch_index + i, request.output_index
                    )
                )
                token = draw(*kept, generator)
            tokens.append(_with_logprobs(token, logprobs, settings.logprobs))
        results.append(tokens)
    return results


def _with_logprobs(token: int, logprobs: torch.Tensor | None, top: int | None) -> SampledToken:
    if logprobs is None or top is None:
        return SampledToken(token)
    alternatives: tuple[tuple[int, float], ...] = ()
    if top > 0:
        values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1]))
        alternatives = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return SampledToken(token, float(logprobs[token]), alternatives)


@dataclass
class PromptRows:
    """Rows of a packed batch whose next token is a known prompt token: `rows` index the
    batch's tokens, `targets` are those next tokens, and `spans` say whose they are
    (sequence id, number of rows, top alternatives to report), in row order."""

    rows: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    spans: list[tuple[int, int, int]] = field(default_factory=list)


def prompt_logprobs(logits: torch.Tensor, prompt_rows: PromptRows) -> dict[int, list[SampledToken]]:
    """Each prompt row's target token with its log-probability under the row's raw logits (the
    model's own distribution: no temperature, penalty or filter) and the span's top
    alternatives, by sequence id in row order."""
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    targets = torch.tensor(prompt_rows.targets, device=logprobs.device)
    chosen = logprobs.gather(-1, targets[:, None])[:, 0].tolist()
    most = max(top for _, _, top in prompt_rows.spans)
    top_values, top_ids = torch.topk(logprobs, most, dim=-1) if most else (None, None)
    results: dict[int, list[SampledToken]] = {}
    row = 0
    for seq_id, count, top in prompt_rows.spans:
        entries = results.setdefault(seq_id, [])
        for i in range(row, row + count):
            alternatives = None
            if top_values is not None and top_ids is not None and top:
                pairs = zip(top_ids[i, :top].tolist(), top_values[i, :top].tolist(), strict=True)
                alternatives = tuple(pairs)
            entries.append(SampledToken(prompt_rows.targets[i], chosen[i], alternatives))
        row += count
    return results
