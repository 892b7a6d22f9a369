"""What both front ends (OpenAI HTTP and gRPC) share: turning an API prompt into one
`GenerateRequest`, the context-length check, engine-error kinds, and reporting each branch's
finish exactly once in a stream.

Invariants:
- a prompt is rendered and tokenized once, in `FrontEnd.prepare`; the length check, the shared
  prefix and (on a routing replica) the block hashes all read that one rendering;
- `prepare` raises `ContextOverflow` (a RequestRejected) before anything is queued when the
  prompt plus `max_tokens` cannot fit in the model's context; the engine itself would silently
  shorten `max_tokens`;
- CPU-heavy request work (parsing a body, rendering and tokenizing a prompt) runs through
  `off_loop` on the front end's own thread pool, never on the caller's event loop, so health
  checks and other requests stay responsive while a large prompt is handled;
- `FinishTracker` yields a branch of a snapshot only when it has new tokens or text or has just
  finished, and each finish once.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

from cluster.engine.errors import EngineDead, EngineOverloaded, RequestRejected
from cluster.engine.generate_request import GenerateRequest, PromptInput, RequestBuilder
from cluster.engine.outputs import CompletionOutput, Logprob, RequestOutput
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.tokenization import PromptRenderer

ENGINE_ERRORS = (RequestRejected, EngineOverloaded, EngineDead, ValueError)
"""Errors an engine raises that are the client's business (each front end maps them)."""


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
    """Prepares API prompts for one engine: its request builder (tokenizer, operator-shared
    prefixes) and its context length."""

    def __init__(self, builder: RequestBuilder, max_model_len: int) -> None:
        self.builder = builder
        self.max_model_len = max_model_len
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
    ) -> GenerateRequest:
        """Renders `prompt` once into a request for the base model or the LoRA `adapter` (a name
        the front end resolved). Raises RequestRejected for a prompt that cannot be rendered
        and ContextOverflow for one that does not fit (`what` names it)."""
        request = self.builder.build(
            prompt,
            params,
            request_id=request_id,
            tenant_salt=tenant_salt,
            adapter=adapter,
            chat_template=chat_template,
            tools=tools,
        )
        overflow = context_overflow(
            request.num_prompt_tokens, params.max_tokens, self.max_model_len, what
        )
        if overflow is not None:
            raise ContextOverflow(overflow)
        return request

    def token_text(self, token_id: int, *, skip_special_tokens: bool = False) -> str:
        return self.renderer.decode([token_id], skip_special_tokens)


def new_logprobs(output: CompletionOutput, whole: bool) -> list[Logprob]:
    """Logprob entries of the output's new tokens (of all its tokens when `whole`)."""
    if output.logprobs is None:
        return []
    return output.logprobs[0 if whole else len(output.token_ids) - len(output.delta_token_ids) :]


class FinishTracker:
    """Which branches of a stream's snapshots have something to send: new tokens or text, or a
    finish not yet reported. Streams are told apart by `index` (one per prompt)."""

    def __init__(self) -> None:
        self._reported: set[tuple[int, int]] = set()

    def changed(self, output: RequestOutput, index: int = 0) -> Sequence[CompletionOutput]:
        changed = []
        for branch in output.outputs:
            newly_finished = branch.finished and (index, branch.index) not in self._reported
            if branch.delta_token_ids or branch.delta_text or newly_finished:
                changed.append(branch)
            if newly_finished:
                self._reported.add((index, branch.index))
        return changed
