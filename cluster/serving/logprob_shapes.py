"""Log-probabilities in OpenAI's response shapes: completions' `logprobs` (tokens, token
logprobs, top alternatives, text offsets), chat's `logprobs.content`, the prompt's tokens that
`echo` puts first, and vLLM's `prompt_logprobs` field (per prompt token, token id -> logprob,
rank and text).

Invariant: the prompt's shapes read `RequestOutput.prompt_logprobs` as the engine recorded it
(None for the first token, then one entry per prompt token) and show at most the number of
alternatives the request asked for.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from cluster.engine.outputs import Logprob, RequestOutput
from cluster.serving.openai_protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprobs,
    PromptTokenLogprob,
    TopLogprob,
)

TokenText = Callable[[int], str]


def completion_logprobs(
    entries: list[Logprob], offset: int, token_text: TokenText
) -> CompletionLogprobs:
    """Completions' `logprobs`; an entry without a logprob and alternatives (an echoed
    prompt's first token) shows `null`s, as OpenAI writes it."""
    tokens = [token_text(e.token_id) for e in entries]
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[e.logprob for e in entries],
        top_logprobs=[
            None
            if e.logprob is None and not e.top
            else {token_text(t): lp for t, lp in e.top.items()}
            for e in entries
        ],
        text_offset=list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset))
        if tokens
        else [],
    )


def chat_logprobs(entries: list[Logprob], token_text: TokenText) -> ChatLogprobs:
    """Chat's `logprobs.content`: each sampled token with its alternatives, most likely first."""

    def top(token_id: int, logprob: float) -> TopLogprob:
        text = token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    content = []
    for entry in entries:
        sampled = top(entry.token_id, entry.logprob if entry.logprob is not None else 0.0)
        alternatives = sorted(entry.top.items(), key=lambda kv: -kv[1])
        content.append(
            ChatTokenLogprob(
                **sampled.model_dump(), top_logprobs=[top(t, lp) for t, lp in alternatives]
            )
        )
    return ChatLogprobs(content=content)


def echoed(
    final: RequestOutput, decode: Callable[[list[int]], str], top: int | None
) -> tuple[str, list[Logprob]]:
    """What `echo` puts before a choice's text and logprobs: the prompt's text (`decode`d
    from its token ids where it was given as ids) and, when the engine computed them, the
    prompt tokens' logprobs with `top` alternatives each (the first token's empty, as OpenAI
    writes it)."""
    ids = final.prompt_token_ids
    text = final.prompt if final.prompt is not None else decode(ids)
    entries = final.prompt_logprobs
    if entries is None or top is None:
        return text, []
    first = Logprob(token_id=ids[0], logprob=None)
    return text, [first, *(_trimmed(e, top) for e in entries[1:] if e is not None)]


def vllm_prompt_logprobs(
    final: RequestOutput, token_text: TokenText, top: int
) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then token id (a JSON key)
    -> its logprob, its rank among the alternatives (absent where it is not one) and its text,
    the prompt token first."""
    entries = final.prompt_logprobs
    if entries is None:
        return None
    shown: list[dict[str, PromptTokenLogprob] | None] = [None]
    for entry in entries[1:]:
        if entry is None:
            shown.append(None)
            continue
        shown.append(
            {
                str(token): PromptTokenLogprob(
                    logprob=value.logprob, rank=value.rank, decoded_token=token_text(token)
                )
                for token, value in _trimmed(entry, top).items()
            }
        )
    return shown


def _trimmed(entry: Logprob, top: int) -> Logprob:
    """`entry` with its `top` most likely alternatives only."""
    if len(entry.top) <= top:
        return entry
    best = sorted(entry.top.items(), key=lambda item: -item[1])[:top]
    return Logprob(entry.token_id, entry.logprob, dict(best))
