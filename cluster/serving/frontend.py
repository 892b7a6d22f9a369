"""What both front ends (OpenAI HTTP and gRPC) share: the one admission path (`FrontEnd.submit`),
the context-length check and what a stream of deltas adds up to.

Invariants:
- a prompt is rendered and tokenized once, in `FrontEnd.prepare`; the length check, the shared
  prefix and the block-hash chain the router reads (`GenerateRequest.block_hashes`) all read
  that one rendering, off the event loop;
- `submit` resolves the model name to an adapter, prepares every prompt and waits for each
  engine stream's first delta, so every refusal (AdapterNotFound, RequestRejected,
  `ContextOverflow`, EngineOverloaded, EngineDead) is raised before a front end answers
  anything; `cluster.serving.error_map` says what each front end answers for it;
- CPU-heavy request work (parsing a body, rendering and tokenizing a prompt) runs through
  `off_loop` on the front end's own thread pool, never on the caller's event loop, so health
  checks and other requests stay responsive while a large prompt is handled;
- front ends read the engine's deltas as they come: a branch appears in a delta only with new
  tokens or text or when it has just finished (each finish once); only a unary answer folds
  them (`OutputAccumulator`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

from cluster.engine.cache_keys import RequestKeys
from cluster.engine.client import EngineClient
from cluster.engine.errors import RequestRejected
from cluster.engine.generate_request import GenerateRequest, PromptInput, RequestBuilder
from cluster.engine.generation_defaults import GenerationDefaults
from cluster.engine.output_stream import BranchDelta, RequestDelta
from cluster.engine.reasoning import ThinkingTags
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.tokenization import PromptRenderer
from cluster.serving.lora_admin import AdapterService

DeltaStream = AsyncGenerator[RequestDelta, None]

P = ParamSpec("P")
T = TypeVar("T")

PREPARE_THREADS = 4
"""Threads a front end renders and parses on; tokenizers release the GIL while encoding."""


class ContextOverflow(RequestRejected):
    """The prompt plus `max_tokens` does not fit in the model's context."""


def context_overflow(
    num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, what: str
) -> str | None:
    """Why `num_prompt_tokens` plus `max_tokens` (None: at least one token) cannot fit in the
    model's context, or None when it fits."""
    wanted = num_prompt_tokens + (max_tokens or 1)
    if wanted <= max_model_len:
        return None
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{wanted} tokens ({num_prompt_tokens} in the {what}, {max_tokens or 1} for the "
        f"completion). Please reduce the length of the {what} or of the completion."
    )


class FrontEnd:
    """Admits API prompts to one engine client: its request builder (tokenizer, operator-shared
    prefixes), its context length, the served adapters, the sampling every front end gives a
    request's unset fields (the model's generation defaults, as the engine read them) and, on a
    routing ingress, the engines' cache keys (to hash each prompt's blocks once, for the
    router)."""

    def __init__(
        self,
        builder: RequestBuilder,
        max_model_len: int,
        engine: EngineClient,
        adapters: AdapterService,
        keys: RequestKeys | None = None,
        *,
        generation_defaults: GenerationDefaults,
    ) -> None:
        self.builder = builder
        self.generation_defaults = generation_defaults
        self.max_model_len = max_model_len
        self.engine = engine
        self.adapters = adapters
        self.keys = keys
        self._executor = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="frontend")

    async def off_loop(self, work: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Runs CPU-heavy `work` on the front end's threads; the event loop stays free (e.g.
        `await frontend.off_loop(frontend.prepare, prompt, params, ...)`, same errors)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(work, *args, **kwargs))

    @property
    def renderer(self) -> PromptRenderer:
        return self.builder.renderer

    def prepare(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        *,
        request_id: str,
        tenant_salt: bytes | None,
        what: str = "prompt",
        adapter: str | None = None,
        chat_template: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        priority: int = 0,
        thinking: ThinkingTags | None = None,
    ) -> GenerateRequest:
        """Renders `prompt` once into a request for the base model or the LoRA `adapter` (a name
        the front end resolved), with its block-hash chain when the front end routes. Raises
        RequestRejected for a prompt that cannot be rendered and ContextOverflow for one that
        does not fit (`what` names it). The other arguments are `RequestBuilder.build`'s."""
        request = self.builder.build(
            prompt,
            params,
            request_id=request_id,
            tenant_salt=tenant_salt,
            adapter=adapter,
            chat_template=chat_template,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            priority=priority,
            thinking=thinking,
        )
        overflow = context_overflow(
            request.num_prompt_tokens, params.max_tokens, self.max_model_len, what
        )
        if overflow is not None:
            raise ContextOverflow(overflow)
        if self.keys is None:
            return request
        return dataclasses.replace(request, block_hashes=tuple(self.routing_hashes(request)))

    def routing_hashes(self, request: GenerateRequest) -> list[bytes]:
        """The chain the router reads: none for an adapter without a digest every replica
        agreed on (routing never uses a key the engines would not use). Raises RequestRejected
        for a bad shared prefix."""
        assert self.keys is not None
        if request.adapter is not None:
            digests = self.adapters.view.digests
            if request.adapter not in digests:
                return []
            self.keys.adapters = dict(digests)  # this front end's copy of the engines' map
        return self.keys.block_hashes(request)

    async def submit(
        self,
        prompts: Sequence[PromptInput],
        params: SamplingParams,
        *,
        model: str,
        request_id: str,
        tenant_salt: bytes | None,
        what: str = "prompt",
        render: Mapping[str, Any] | None = None,
        priority: int = 0,
        thinking: ThinkingTags | None = None,
    ) -> Submission:
        """The one admission path: resolve `model`, prepare every prompt off the loop, start one
        engine stream per prompt (ids `request_id`, or `request_id-i` for several) and wait for
        each first delta. `render`: `chat_template` / `tools` / `chat_template_kwargs` for the
        chat renderer; `priority`: the scheduling priority of every prompt's request;
        `thinking`: the reasoning parser's tags (None: none). Raises
        what the module doc lists; closing a returned stream aborts its request."""
        adapter = await self.adapters.resolve(model)
        requests = [
            await self.off_loop(
                self.prepare,
                prompt,
                params,
                request_id=request_id if len(prompts) == 1 else f"{request_id}-{i}",
                tenant_salt=tenant_salt,
                what=what,
                adapter=adapter,
                priority=priority,
                thinking=thinking,
                **(render or {}),
            )
            for i, prompt in enumerate(prompts)
        ]
        streams: list[DeltaStream] = []
        served_by = None
        try:
            for request in requests:
                stream = self.engine.generate(request)
                first = await anext(stream)
                served_by = served_by or first.served_by
                streams.append(_chain(first, stream))
        except BaseException:
            for started in streams:
                await started.aclose()
            raise
        return Submission(streams, adapter, served_by)

    def token_text(self, token_id: int, *, skip_special_tokens: bool = False) -> str:
        return self.renderer.decode([token_id], skip_special_tokens)


@dataclass
class Submission:
    """A request admitted by `submit`: one started stream per prompt (each one's first delta
    already arrived), the adapter it runs under (None: the base model) and the engine replica
    that served the first prompt (None in process)."""

    streams: list[DeltaStream]
    adapter: str | None
    served_by: str | None


async def _chain(first: RequestDelta, rest: DeltaStream) -> DeltaStream:
    try:
        yield first
        async for delta in rest:
            yield delta
    finally:
        await rest.aclose()


@dataclass
class StreamTally:
    """What a stream of deltas adds up to without keeping its tokens: the usage and, per
    branch, the characters already streamed (a completion's logprob `text_offset`)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    streamed_chars: dict[int, int] = field(default_factory=dict)

    def add(self, delta: RequestDelta) -> None:
        if delta.prompt_token_ids is not None:
            self.prompt_tokens = len(delta.prompt_token_ids)
        self.cached_tokens = delta.num_cached_tokens
        for branch in delta.branches:
            self.completion_tokens += len(branch.token_ids)

    def text_offset(self, branch: BranchDelta) -> int:
        """Characters of the branch streamed before `branch` (call once per branch delta)."""
        offset = self.streamed_chars.get(branch.index, 0)
        self.streamed_chars[branch.index] = offset + len(branch.text)
        return offset
