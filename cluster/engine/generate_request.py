"""One request as every layer passes it, and the one place a prompt becomes one.

A prompt enters the system once (HTTP, gRPC, the Python API, a handle caller) and is rendered
and tokenized there, by `RequestBuilder.build`, into a frozen `GenerateRequest`. Every layer
below (front ends, routing, `AsyncEngine`, `EngineCore`, the scheduler) passes that object
whole, so no layer re-declares the request's parameters and none tokenizes it again.

Invariants:
- `GenerateRequest.prompt.token_ids` are exactly the ids the engine runs (already rendered with
  the chat template, special tokens added as the tokenizer adds them to a text prompt);
- `shared_prefix_tokens` only ever counts leading tokens equal to an operator-declared shared
  prefix's tokens, so no tenant's own text is cached without its salt;
- building a request never touches the engine's state: it can run on any thread or replica
  that has the same tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from cluster.engine.reasoning import ThinkingTags
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.tokenization import PromptRenderer, RenderedPrompt
from cluster.kv_transfer.hint import KVSourceHint
from workers.plan import SampledToken

PromptInput = str | Sequence[Mapping[str, Any]] | Mapping[str, Any]
"""Text, chat messages (a list of {"role", "content"}), {"prompt_token_ids": [...]} or
{"prompt": text}."""


@dataclass(frozen=True)
class GenerateRequest:
    """A rendered prompt with everything the engine needs to run and cache it.

    `request_id` None lets the engine name it; `tenant_salt` (derived on the server from the
    caller's API key, never from a request field) salts every cached block but the first
    `shared_prefix_tokens // block_size` ones; `adapter` names a LoRA adapter (None: the base
    model)."""

    prompt: RenderedPrompt
    params: SamplingParams
    request_id: str | None = None
    tenant_salt: bytes | None = None
    adapter: str | None = None
    shared_prefix_tokens: int = 0
    block_hashes: tuple[bytes, ...] = ()
    """The chain of its blocks a prefix lookup could hit, hashed once where it was prepared
    (a routing ingress: the router reads it); empty where nothing routes by it."""
    kv_source: KVSourceHint | None = None
    """Pull the leading blocks from this replica before computing (a replica that just
    computed them); on any failure they are computed. None: the engine decides alone."""
    prefill_only: bool = False
    """Stop after the first sampled token, handing the request off (`cluster.engine.handoff`)."""
    resume: tuple[SampledToken, ...] = ()
    """Tokens another engine already sampled for it: generation goes on after them
    (`cluster.engine.handoff`)."""
    thinking: ThinkingTags | None = None
    """The served reasoning parser's tags (None: no parser): a structured-outputs constraint
    then applies only after the thinking span (`cluster.engine.reasoning`)."""
    priority: int = 0
    """vLLM's request priority: lower runs first (ties by arrival). Only an engine with
    `scheduler.scheduling_policy: priority` takes a non-zero one."""

    @property
    def token_ids(self) -> list[int]:
        return self.prompt.token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt.token_ids)


def leading_shared_tokens(
    token_ids: Sequence[int], shared_prefixes: Iterable[Sequence[int]], block_size: int
) -> int:
    """Leading tokens of the prompt, in whole blocks, that are tokens of an operator-shared
    prefix: the longest run of leading tokens equal to some shared prefix's tokens, rounded down
    to a block boundary (a block is shared only when every token in it is the operator's)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    best = 0
    for prefix in shared_prefixes:
        common = 0
        for mine, theirs in zip(token_ids, prefix, strict=False):
            if mine != theirs:
                break
            common += 1
        best = max(best, common)
    return best - best % block_size


class RequestBuilder:
    """Renders and tokenizes prompts into `GenerateRequest`s for one tokenizer.

    `shared_prefixes` are operator-chosen prompt beginnings (text as the rendered prompt begins);
    each is kept as token ids both as a text prompt tokenizes (special tokens added) and as a
    rendered chat prompt does (none added)."""

    def __init__(
        self, renderer: PromptRenderer, block_size: int, shared_prefixes: Sequence[str] = ()
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.renderer = renderer
        self.block_size = block_size
        variants: list[tuple[int, ...]] = []
        tokenizer = renderer.tokenizer
        for text in shared_prefixes:
            for ids in (renderer.encode(text), tokenizer.encode(text, add_special_tokens=False)):
                if tuple(ids) not in variants:
                    variants.append(tuple(ids))
        self.shared_prefixes: tuple[tuple[int, ...], ...] = tuple(variants)

    def build(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        tenant_salt: bytes | None = None,
        chat_template: str | None = None,
        adapter: str | None = None,
        shared_prefix_tokens: int | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        priority: int = 0,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        thinking: ThinkingTags | None = None,
    ) -> GenerateRequest:
        """Renders `prompt` once, keeping only its last `params.truncate_prompt_tokens` tokens
        when that is set (the prompt text stays as given). Raises RequestRejected for a prompt
        that cannot be rendered.

        `shared_prefix_tokens` None derives it from the operator's shared prefixes; an explicit
        value is passed through (the engine checks it against the prompt's length). `tools`
        and `chat_template_kwargs` go to the chat template; `priority` is the request's
        scheduling priority; `thinking` the reasoning parser's tags (a constraint then waits for
        the end of the thinking span)."""
        rendered = self.renderer.render(
            prompt,
            chat_template=chat_template,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
        )
        keep = params.truncate_prompt_tokens
        if keep is not None and 0 < keep < len(rendered.token_ids):
            rendered = replace(rendered, token_ids=rendered.token_ids[-keep:])
        if shared_prefix_tokens is None:
            shared_prefix_tokens = self.shared_tokens(rendered.token_ids)
        return GenerateRequest(
            prompt=rendered,
            params=params,
            request_id=request_id,
            tenant_salt=tenant_salt,
            adapter=adapter,
            shared_prefix_tokens=shared_prefix_tokens,
            priority=priority,
            thinking=thinking,
        )

    def shared_tokens(self, token_ids: Sequence[int]) -> int:
        """Leading whole-block tokens of `token_ids` that are an operator-shared prefix."""
        if not self.shared_prefixes:
            return 0
        return leading_shared_tokens(token_ids, self.shared_prefixes, self.block_size)
