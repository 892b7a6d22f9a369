"""The offline facade: `LLM(model=...).generate(prompts, SamplingParams(...))`, no Ray knowledge
needed. It drives `EngineCore`'s one step path in the calling thread and returns finished outputs
in the order of the prompts. A request the workers refuse raises RequestFailed (the others of the
call are aborted and the engine serves the next call); one that can never be served raises
RequestRejected."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from cluster.engine.config import EngineConfig, SpeculativeSettings
from cluster.engine.engine_core import EngineCore
from cluster.engine.errors import ConfigError, RequestFailed, RequestRejected
from cluster.engine.generate_request import PromptInput
from cluster.engine.lora_request import LoRARequest
from cluster.engine.metrics import EngineMetrics
from cluster.engine.outputs import RequestOutput
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.step_pipeline import StepPipeline, ThreadLauncher
from cluster.engine.vllm_args import NAMES as VLLM_ONLY_NAMES
from cluster.engine.vllm_args import merge_overrides, vllm_overrides
from workers.plan import StepOutput


def config_from_kwargs(
    model: str | None, base: EngineConfig | None = None, **kwargs: Any
) -> EngineConfig:
    """An EngineConfig from flat keyword arguments (`block_size=8, tensor_parallel_size=2`, and
    vLLM's `speculative_config={...}`, `swap_space=4`, `enforce_eager=True`, ...:
    `cluster.engine.vllm_args`) over `base`; `model=None` keeps the base's model. Without a
    base, `backend` defaults to the in-process worker when tensor_parallel_size is 1."""
    vllm_values = {name: kwargs.pop(name) for name in list(kwargs) if name in VLLM_ONLY_NAMES}
    overrides: dict[str, dict[str, Any]] = {}
    if model is not None:
        overrides["model"] = {"model": model}
    speculative = kwargs.pop("speculative_config", None)
    if speculative is not None:  # vLLM's dict: {"method": "ngram", ...}
        overrides["speculative"] = SpeculativeSettings.from_vllm(speculative)
    for name, value in kwargs.items():
        section = EngineConfig.section_of(name)
        if section is None:
            raise ConfigError(f"LLM() got an unknown setting {name!r}")
        overrides.setdefault(section, {})[name] = value
    overrides = merge_overrides(overrides, vllm_overrides(vllm_values))
    config = (base or EngineConfig()).with_overrides(overrides)
    return config if base is not None else config.single_rank_in_process("backend" in kwargs)


class LLM:
    """Offline batch generation. Keyword arguments are EngineConfig fields by name."""

    def __init__(
        self, model: str | None = None, *, config: EngineConfig | None = None, **kwargs: Any
    ) -> None:
        """`model` defaults to the config's (SmolLM2-135M-Instruct without a config)."""
        self.engine = EngineCore(config_from_kwargs(model, config, **kwargs))
        self.config = self.engine.config
        overlap = self.config.scheduler.async_scheduling
        self._launcher = ThreadLauncher(self.engine, overlap=overlap)
        self._pipeline: StepPipeline[Future[StepOutput | Exception | None]] = StepPipeline(
            self.engine, self._launcher, overlap=overlap
        )

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Text prompts, {"prompt": text} or {"prompt_token_ids": [...]} dicts; one result per
        prompt, in order. Without `sampling_params`: `get_default_sampling_params()`.

        `lora_request`: one adapter for every prompt, or one (or None: the base model) per
        prompt. An adapter not loaded yet is loaded first (as vLLM does). `use_tqdm` shows a
        progress bar of finished requests on a terminal (as vLLM does; never in a pipe).
        `priority`: one per prompt (vLLM's signature; lower runs first), only with
        `scheduling_policy="priority"`."""
        if isinstance(prompts, str | Mapping):
            prompts = [prompts]
        prompts = list(prompts)
        return self._run(
            prompts,
            sampling_params,
            chat_template=None,
            lora=lora_request,
            use_tqdm=use_tqdm,
            priority=priority,
        )

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; rendered with the chat template,
        `chat_template_kwargs` its extra variables (vLLM's, e.g. `{"enable_thinking": False}`).
        `lora_request` and `use_tqdm` as in `generate`."""
        if messages and isinstance(messages[0], Mapping):
            conversations: list[Any] = [messages]
        else:
            conversations = list(messages)
        return self._run(
            conversations,
            sampling_params,
            chat_template=chat_template,
            lora=lora_request,
            use_tqdm=use_tqdm,
            chat_template_kwargs=chat_template_kwargs,
        )

    def get_default_sampling_params(self) -> SamplingParams:
        """The parameters `generate` and `chat` use when given none (vLLM's): the model's
        generation defaults (`model.generation_config`) over `SamplingParams()`."""
        return self.engine.generation_defaults.sampling_params()

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer every prompt is encoded and every output decoded with (vLLM's
        `LLM.get_tokenizer`)."""
        return self.engine.request_builder.renderer.tokenizer

    def add_lora(self, lora: LoRARequest) -> None:
        """Loads and serves an adapter (see `EngineCore.add_lora`)."""
        self.engine.add_lora(lora)

    def remove_lora(self, lora_name: str) -> None:
        self.engine.remove_lora(lora_name)

    def list_loras(self) -> list[LoRARequest]:
        return self.engine.list_loras()

    def metrics(self) -> EngineMetrics:
        return self.engine.metrics()

    def shutdown(self) -> None:
        self._launcher.close()
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _run(
        self,
        prompts: list[Any],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        *,
        chat_template: str | None,
        lora: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _per_prompt(sampling_params, len(prompts))
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"{len(priorities)} priorities for {len(prompts)} prompts")
        adapters = _per_prompt_lora(lora, len(prompts))
        for adapter in dict.fromkeys(a for a in adapters if a is not None):
            self.engine.add_lora(adapter)  # a no-op when served already from that path
        builder = self.engine.request_builder
        requests = [
            builder.build(
                prompt,
                p,
                chat_template=chat_template,
                adapter=None if adapter is None else adapter.lora_name,
                priority=rank,
                chat_template_kwargs=chat_template_kwargs,
            )
            for prompt, p, adapter, rank in zip(prompts, params, adapters, priorities, strict=True)
        ]
        engine = self.engine
        ids: list[str] = []
        try:
            for request in requests:
                ids.append(engine.add_request(request).request_id)
        except BaseException:  # none of a refused batch is left queued for the next call
            for queued in ids:
                engine.abort(queued)
            raise
        finals: dict[str, RequestOutput] = {}
        pipeline = self._pipeline
        # disable=None: a bar only on a terminal
        progress = tqdm(total=len(ids), desc="generate", disable=None if use_tqdm else True)
        try:
            while (in_flight := pipeline.start()) is not None:
                pipeline.advance(in_flight.result())
                for request in pipeline.settle():
                    if request.error is not None:
                        for other in ids:
                            engine.abort(other)
                        error = RequestFailed if request.failed else RequestRejected
                        raise error(f"request {request.request_id}: {request.error}")
                    if request.finished:  # its first output: its deltas cover everything
                        finals[request.request_id] = request.make_output()
                        progress.update()
        finally:  # a step launched ahead of an error ends here, its tokens dropped
            progress.close()
            pipeline.drain(Future.result)
        return [finals[i] for i in ids]


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams], count: int
) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"{len(params)} sampling params for {count} prompts")
    return list(params)


def _per_prompt_lora(
    lora: LoRARequest | Sequence[LoRARequest | None] | None, count: int
) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * count
    if len(lora) != count:
        raise ValueError(f"{len(lora)} lora requests for {count} prompts")
    return list(lora)
