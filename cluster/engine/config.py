"""Engine configuration: pydantic models loadable from YAML and from command-line flags.

Pydantic lives only here, at the edge; the engine reads the validated values. Every section
forbids unknown fields, and every refused combination names the field (`section.field`) at fault.
A field the workers also receive takes its default from `WorkerConfig` (`worker_default`), the one
source of those knobs' defaults and rules; `to_worker_config` copies the values by name.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from dataclasses import fields, replace
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from cluster.engine.config_flags import add_section_flags, section_values
from cluster.engine.errors import ConfigError, describe_validation_error
from cluster.engine.generation_defaults import AUTO, HF_KEYS, generation_defaults, parse_override
from cluster.engine.vllm_args import (
    FLAG_GROUP,
    add_vllm_flags,
    merge_overrides,
    vllm_overrides,
)
from kv_layouts import LAYOUT_NAMES, layout_named
from workers.config import WorkerConfig, WorkerConfigError


def worker_default(name: str) -> Any:
    """`WorkerConfig`'s default for the field `name` (the sections below never restate one)."""
    return WorkerConfig.__dataclass_fields__[name].default


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSettings(_Section):
    model: str = Field(
        worker_default("model"), description="a .gguf file, an HF directory, or 'default'"
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        worker_default("dtype"),
        description="auto: bfloat16 on CUDA and on CPUs where it is native and faster (AMX, "
        "AMD's AVX512-BF16), float32 with int8 products (quantized_activations) on other "
        "CPUs; float32 is the exact mode",
    )
    max_model_len: int | None = Field(
        worker_default("max_model_len"), description="default: the model's context"
    )
    seed: int = Field(
        worker_default("seed"),
        ge=0,
        description="seed of requests that do not give one (with a counter)",
    )
    weights_cache_dir: str | None = worker_default("weights_cache_dir")
    quantized_decode: bool = Field(
        worker_default("quantized_decode"),
        description="CPU: decode-sized calls (<= 8 rows in bfloat16, <= 16 in float32) multiply "
        "GGUF Q4_1 weights as 4-bit codes with a native kernel (the exact checkpoint weights, "
        "0.75 bytes per weight read instead of 2 or 4); off: every product uses the dtype's "
        "dequantized weights",
    )
    quantized_activations: bool | Literal["auto"] = Field(
        worker_default("quantized_activations"),
        description="CPU: products on a GGUF file's codes quantize activations to int8 per "
        "block of 32 and multiply the codes with integer dot products (AVX2 or better; "
        "single-sequence decode steps stay exact): faster, not float32-exact; auto: on "
        "where dtype auto picks float32 on a CPU, off with any dtype given",
    )
    generation_config: str = Field(
        AUTO,
        description="vLLM's: the sampling a request gets for fields it leaves unset: 'auto', "
        "the model's recommendation (an HF generation_config.json, a GGUF file's "
        "general.sampling keys, the default model's card); 'vllm', the engine's own "
        "(temperature 1.0, OpenAI's nominal default, no filters); or a folder holding a "
        "generation_config.json",
    )
    override_generation_config: dict[str, Any] = Field(
        {},
        description="vLLM's: JSON merged over those defaults, e.g. '{\"temperature\": 0.5}' "
        f"(keys: {', '.join(HF_KEYS)}); with generation_config 'vllm' only these apply",
    )

    @field_validator("override_generation_config", mode="before")
    @classmethod
    def _override_generation_json(cls, value: Any) -> Any:
        return parse_override(value)


class CacheSettings(_Section):
    block_size: int = Field(worker_default("block_size"), le=256)
    num_device_blocks: int | None = worker_default("num_device_blocks")
    kv_cache_bytes: int | None = Field(
        worker_default("kv_cache_bytes"), description="device KV budget (CPU backend)"
    )
    gpu_memory_utilization: float = worker_default("gpu_memory_utilization")
    num_cpu_blocks: int | None = worker_default("num_cpu_blocks")
    swap_space_bytes: int = worker_default("swap_space_bytes")
    watermark: float = Field(
        0.01, ge=0.0, lt=1.0, description="device fraction kept free at admission"
    )
    enable_prefix_caching: bool = True
    cpu_cache: bool = Field(
        True,
        description="the CPU pool is a second cache tier: evicted prefix blocks are demoted to it "
        "and promoted back on a hit (on|off; needs the paged layout, prefix caching, CPU blocks "
        "and no hybrid KV groups, else it stays off)",
    )
    verify_swaps: bool = Field(
        worker_default("verify_swaps"),
        description="checksum blocks copied to the CPU and check them on the way back",
    )
    kv_layout: str = Field(
        worker_default("kv_layout"),
        description=f"KV memory layout, one of {', '.join(LAYOUT_NAMES)}: paged blocks, or the "
        "research baselines, contiguous max-length reservations and per-sequence virtual "
        "ranges committed on demand (CPU); prefix caching, swap and n > 1 need 'paged'",
    )
    disable_hybrid_kv_cache_manager: bool = Field(
        worker_default("disable_hybrid_kv_cache_manager"),
        description="keep every layer's KV blocks for every sequence (vLLM's flag); by default "
        "a model with sliding-window layers groups its layers by window and each sliding group "
        "frees the blocks its window has passed (needs kv_layout 'paged'; no CPU cache tier, "
        "KV index or KV transfers with it)",
    )
    kv_cache_dtype: Literal["auto", "int8", "fp8", "fp8_e4m3"] = Field(
        worker_default("kv_cache_dtype"),
        description="how KV is stored (vLLM's flag): auto, the model's dtype; int8 (CPU), int8 "
        "codes with a bfloat16 scale per token and head, about half of bfloat16's bytes; "
        "fp8_e4m3 or its alias fp8 (CUDA), fp8 values with a scale of 1; quantized caches need "
        "kv_layout 'paged'",
    )

    @model_validator(mode="after")
    def _one_device_budget(self) -> CacheSettings:
        if self.num_device_blocks is not None and self.kv_cache_bytes is not None:
            raise ValueError(
                "cache.num_device_blocks and cache.kv_cache_bytes are exclusive: give one"
            )
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"cache.block_size must be a power of two, got {self.block_size}")
        return self


class ParallelSettings(_Section):
    tensor_parallel_size: int = worker_default("tensor_parallel_size")
    backend: Literal["ray", "local"] = worker_default("backend")
    device: Literal["auto", "cpu", "cuda"] = Field(
        worker_default("device"),
        description="where ranks compute: 'auto' is CUDA when a rank's bundle holds a GPU; "
        "'cpu' keeps them on the CPU whatever the bundles declare (tests, simulated clusters)",
    )
    num_threads: int | Literal["auto"] | None = Field(
        worker_default("num_threads"),
        description="CPU ranks: torch intra-op threads set in the process running the rank; "
        "'auto' = the cores the process may use, shared among the TP ranks; unset leaves "
        "torch's (Ray's OMP_NUM_THREADS)",
    )
    enable_expert_parallel: bool = Field(
        worker_default("enable_expert_parallel"),
        description="mixture-of-experts models: whole experts per rank instead of every "
        "expert's intermediate columns split across the tensor-parallel ranks",
    )


class SchedulerSettings(_Section):
    max_num_seqs: Annotated[int, Field(gt=0)] | Literal["auto"] = Field(
        64,
        description="running sequences (branches) at once; 'auto': what the engine's device "
        "runs best (64 on CUDA and AMX CPUs, 16 on other CPUs; never above the step budget)",
    )
    max_num_batched_tokens: int = Field(512, gt=0, description="token budget per step")
    max_prefill_tokens: int | None = Field(
        None,
        gt=0,
        description="prompt tokens per step while any sequence decodes (protects time per "
        "output token); unset: prompts may take the whole step budget",
    )
    enable_chunked_prefill: bool = True
    preemption_mode: Literal["auto", "recompute", "swap"] = "auto"
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs",
        description="vLLM's --scheduling-policy: 'fcfs' serves requests in arrival order; "
        "'priority' by each request's `priority` (lower first, then arrival), preempting the "
        "lowest-priority running request first when memory runs short",
    )
    max_waiting_requests: int = Field(4096, gt=0, description="admission queue limit")
    max_queue_wait_s: float | None = Field(
        300.0,
        gt=0,
        description="refuse a request (503 with Retry-After) when requests wait and the measured "
        "drain rate predicts it would wait longer than this to start; unset: never by time",
    )
    check_integrity: bool = Field(False, description="run the block manager's check every step")
    async_scheduling: bool = Field(
        False,
        description="plan the next step while the current one runs: plain decodes get "
        "placeholders for the tokens in flight, which the workers fill; other steps overlap only "
        "the last one's text, stop strings and outputs (a branch that ends then costs one "
        "dropped token)",
    )

    @model_validator(mode="after")
    def _budget_covers_decodes(self) -> SchedulerSettings:
        if self.max_num_seqs != "auto" and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"scheduler.max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"scheduler.max_num_seqs ({self.max_num_seqs}) so every running decode fits a step"
            )
        if self.max_prefill_tokens is not None and not self.enable_chunked_prefill:
            raise ValueError(
                "scheduler.max_prefill_tokens needs scheduler.enable_chunked_prefill: a whole "
                "prompt longer than the cap would wait for every decode to end"
            )
        return self

    def seats(self, device: str) -> int:
        """`max_num_seqs` as a number for an engine on `device` ("cpu" or "cuda"): "auto" is
        `workers.cpu_features.auto_max_num_seqs` for this process's CPU, capped at the step
        budget so every running decode still fits a step."""
        if self.max_num_seqs != "auto":
            return self.max_num_seqs
        from workers.cpu_features import auto_max_num_seqs

        return min(auto_max_num_seqs(device), self.max_num_batched_tokens)

    def check_context(self, max_model_len: int) -> None:
        """Without chunked prefill a prompt is scheduled whole, so one step's token budget must
        hold the longest context. Raises ValueError naming both settings."""
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"scheduler.max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"the model's context ({max_model_len}) when chunked prefill is off; raise it "
                "or set model.max_model_len"
            )


class LoRASettings(_Section):
    """Multi-LoRA serving (vLLM's flags): adapters live in a CPU-resident LRU of
    `max_cpu_loras`, and at most `max_loras` distinct adapters run in one step (device slots)."""

    enable_lora: bool = False
    max_loras: int = Field(4, gt=0, description="distinct adapters in one step (device slots)")
    max_lora_rank: int = Field(
        worker_default("max_lora_rank"), le=512, description="largest adapter rank accepted"
    )
    max_cpu_loras: int | None = Field(
        None, gt=0, description="adapters kept loaded in CPU memory (default: max_loras)"
    )


class SpeculativeSettings(_Section):
    """Speculative decoding (vLLM's `speculative_config`; `cluster.engine.speculation`).

    `speculative_method: ngram` proposes up to `num_speculative_tokens` drafts per decoding
    sequence by prompt lookup (n-grams of `prompt_lookup_min..prompt_lookup_max` tokens) and
    verifies them in the same step. Tokens are the ones plain decoding produces; only the
    number of steps changes. Each draft is one more row in the step: `speculative_max_rows`
    caps the rows drafts may fill (on CPU, where rows past the 4-bit kernels' few cost as much
    as decodes), and `speculative_disable_by_batch_size` turns drafts off from that many
    decoding sequences on."""

    speculative_method: Literal["ngram"] | None = Field(
        None, description="'ngram' (prompt lookup) turns speculative decoding on"
    )
    num_speculative_tokens: int = Field(3, gt=0, le=16, description="drafts per sequence")
    prompt_lookup_max: int = Field(4, gt=0, description="longest n-gram looked up")
    prompt_lookup_min: int = Field(2, gt=0, description="shortest n-gram looked up")
    speculative_disable_by_batch_size: int | None = Field(
        None, gt=0, description="no drafts while this many sequences decode (unset: always)"
    )
    speculative_max_rows: int | None = Field(
        None,
        gt=0,
        description="rows (decodes plus drafts) a step's drafts may fill; the drafts share "
        "what one row per decode leaves (unset: num_speculative_tokens each)",
    )

    @model_validator(mode="after")
    def _lookup_range(self) -> SpeculativeSettings:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"speculative.prompt_lookup_max ({self.prompt_lookup_max})"
            )
        return self

    @staticmethod
    def from_vllm(config: dict[str, Any]) -> dict[str, Any]:
        """This section's fields from vLLM's `speculative_config` keys (`method`,
        `num_speculative_tokens`, `prompt_lookup_max`, `prompt_lookup_min`,
        `disable_by_batch_size`, and ours: `max_rows`); an unknown key is an error."""
        names = {
            "method": "speculative_method",
            "num_speculative_tokens": "num_speculative_tokens",
            "prompt_lookup_max": "prompt_lookup_max",
            "prompt_lookup_min": "prompt_lookup_min",
            "disable_by_batch_size": "speculative_disable_by_batch_size",
            "max_rows": "speculative_max_rows",
        }
        if not isinstance(config, dict):
            raise ConfigError(f"speculative_config must be a mapping, got {config!r}")
        unknown = sorted(set(config) - set(names))
        if unknown:
            raise ConfigError(f"speculative_config: unknown keys {unknown}; known: {sorted(names)}")
        return {names[key]: value for key, value in config.items()}

    @staticmethod
    def parse_flag(flag: str) -> dict[str, Any] | None:
        """`--speculative-config`'s value: vLLM's JSON as this section's fields, or None for
        "none" / "null" (speculative decoding off). Raises ConfigError for anything else."""
        if flag.strip().lower() in ("none", "null"):
            return None
        try:
            parsed = json.loads(flag)
        except json.JSONDecodeError as error:
            raise ConfigError(f"--speculative-config is not JSON: {error}") from None
        return SpeculativeSettings.from_vllm(parsed)


class EngineConfig(_Section):
    """The whole engine configuration. Construct directly, `from_yaml`, or `from_cli_args`."""

    model: ModelSettings = Field(default_factory=ModelSettings)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    parallel: ParallelSettings = Field(default_factory=ParallelSettings)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    lora: LoRASettings = Field(default_factory=LoRASettings)
    speculative: SpeculativeSettings = Field(default_factory=SpeculativeSettings)

    @model_validator(mode="after")
    def _cross_section(self) -> EngineConfig:
        swap_possible = self.cache.num_cpu_blocks != 0 and (
            self.cache.num_cpu_blocks is not None or self.cache.swap_space_bytes > 0
        )
        if self.scheduler.preemption_mode == "swap" and not swap_possible:
            raise ValueError(
                "scheduler.preemption_mode 'swap' needs a CPU tier: set cache.num_cpu_blocks > 0 "
                "or cache.swap_space_bytes > 0"
            )
        if self.model.max_model_len is not None:
            self.scheduler.check_context(self.model.max_model_len)
        self._check_worker_settings()  # an unknown cache.kv_layout is refused here
        layout_named(self.cache.kv_layout).validate(self)
        return self

    def _check_worker_settings(self) -> None:
        """The workers' own rules on the knobs they receive (`WorkerConfig`, their one
        definition), reported as `section.field: message`."""
        try:
            self.to_worker_config()
        except WorkerConfigError as error:
            section = EngineConfig.section_of(error.field)
            name = error.field if section is None else f"{section}.{error.field}"
            raise ValueError(f"{name}: {error}") from None

    def engine_device(self) -> str:
        """Where this process's engine computes, as far as it can tell: the local backend's rule
        (`workers.placement.local_device`; the ranks' own bundles decide for Ray ranks)."""
        from workers.placement import local_device

        return local_device(self.parallel.device)

    def resolved(self) -> EngineConfig:
        """This config with `scheduler.max_num_seqs: auto` made a number for the device and CPU
        of the process that calls it (the engine's: `EngineCore` resolves it first)."""
        if self.scheduler.max_num_seqs != "auto":
            return self
        seats = self.scheduler.seats(self.engine_device())
        return self.with_overrides({"scheduler": {"max_num_seqs": seats}})

    # --- construction helpers -------------------------------------------------------------

    def single_rank_in_process(self, backend_given: bool) -> EngineConfig:
        """For offline use (`LLM`, `pagedserve generate`): with one rank and no backend asked
        for, the rank runs in this process (`parallel.backend` "local") instead of a Ray actor."""
        if backend_given or self.parallel.tensor_parallel_size != 1:
            return self
        return self.with_overrides({"parallel": {"backend": "local"}})

    @classmethod
    def build(cls, data: dict[str, Any]) -> EngineConfig:
        """Validate a nested dict; raises ConfigError naming the offending field."""
        try:
            return cls.model_validate(data)
        except ValidationError as error:
            raise ConfigError(
                f"invalid engine configuration: {describe_validation_error(error)}"
            ) from None

    @classmethod
    def from_yaml(cls, path: str | pathlib.Path) -> EngineConfig:
        text = pathlib.Path(path).read_text()
        data = yaml.safe_load(text) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        return cls.build(data)

    def with_overrides(self, overrides: dict[str, dict[str, Any]]) -> EngineConfig:
        """A copy with `{section: {field: value}}` replaced, validated again."""
        data = self.model_dump()
        for section, values in overrides.items():
            data.setdefault(section, {}).update(values)
        return EngineConfig.build(data)

    def check_model(self) -> None:
        """Checks what only the model can tell, from its metadata (no weights are read): that we
        run its architecture and can read its GGUF tensor types (`model.model`), that its
        generation defaults (`model.generation_config`) can be read and are valid, that
        `model.max_model_len` fits its context, and that `parallel.tensor_parallel_size` (with
        `parallel.enable_expert_parallel`) splits its heads, KV heads, MLP and experts. Raises
        ConfigError naming the field, the value and what would be accepted; call it when the
        config is loaded (a replica would otherwise fail in its constructor, again and again)."""
        from workers.loader import read_spec
        from workers.model_source import resolve_model_path
        from workers.parallel import check_tensor_parallel

        try:
            spec = read_spec(resolve_model_path(self.model.model))
        except (OSError, ValueError) as error:
            raise ConfigError(f"model.model {self.model.model!r}: {error}") from None
        try:
            generation_defaults(self.model)
        except (OSError, ValueError) as error:
            raise ConfigError(str(error)) from None
        context = spec.max_position_embeddings
        if self.model.max_model_len is not None and self.model.max_model_len > context:
            raise ConfigError(
                f"model.max_model_len {self.model.max_model_len} exceeds the context length of "
                f"model.model {self.model.model!r} ({context}); give at most {context}"
            )
        parallel = self.parallel
        try:
            check_tensor_parallel(
                spec, parallel.tensor_parallel_size, parallel.enable_expert_parallel
            )
        except ValueError as error:
            field = "parallel.tensor_parallel_size"
            if parallel.enable_expert_parallel:
                field = f"{field} with parallel.enable_expert_parallel"
            raise ConfigError(
                f"{field} cannot split model.model {self.model.model!r}: {error}"
            ) from None

    def to_worker_config(self) -> WorkerConfig:
        """The workers' config: every field of the model, cache and parallel sections that
        `WorkerConfig` has, by name, plus what the workers derive from the rest."""
        accepted = {f.name for f in fields(WorkerConfig)}
        copied = {
            name: value
            for section in (self.model, self.cache, self.parallel)
            for name, value in section
            if name in accepted
        }
        config = WorkerConfig(
            **copied,
            max_num_seqs=self.scheduler.seats(self.engine_device()),
            max_loras=self.lora.max_loras if self.lora.enable_lora else 0,
            max_lora_rank=self.lora.max_lora_rank,
        )
        if layout_named(self.cache.kv_layout).has_swap_tier:
            return config
        # a layout without a swap tier gets no CPU pool
        return replace(config, num_cpu_blocks=None, swap_space_bytes=0)

    # --- command line -------------------------------------------------------------------------

    @staticmethod
    def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
        """One flag per field, `--field-name` (field names are unique across sections), plus
        `--config FILE.yaml`; flags given override the file."""
        parser.add_argument("--config", type=pathlib.Path, default=None, help="YAML config file")
        parser.add_argument(
            "--speculative-config",
            default=None,
            metavar="JSON",
            help='vLLM\'s speculative config, e.g. \'{"method": "ngram", '
            '"num_speculative_tokens": 3, "prompt_lookup_max": 4}\'; "none": off (the '
            "speculative settings' own flags override it)",
        )
        EngineConfig.add_section_groups(parser)
        add_vllm_flags(parser)

    @staticmethod
    def add_section_groups(
        parser: argparse.ArgumentParser,
        exclude: tuple[str, ...] = (),
        default_source: str | None = None,
    ) -> None:
        """One argument group per section (but `exclude`), one flag per field
        (`add_section_flags`): the one definition of every engine flag, for each command that
        takes them. `default_source` says where a flag not given comes from, in its help."""
        for section_name, section_type in _SECTIONS.items():
            if section_name in exclude:
                continue
            group = parser.add_argument_group(f"engine {section_name} settings")
            add_section_flags(group, section_name, section_type, default_source)

    @staticmethod
    def section_names() -> tuple[str, ...]:
        return tuple(_SECTIONS)

    @staticmethod
    def section_of(field_name: str) -> str | None:
        """The section (`model`, `cache`, ...) that holds a field, or None if none does."""
        for section_name, section_type in _SECTIONS.items():
            if field_name in section_type.model_fields:
                return section_name
        return None

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        base = cls.from_yaml(args.config) if args.config is not None else cls()
        overrides: dict[str, dict[str, Any]] = {}
        vllm_speculative = getattr(args, "speculative_config", None)
        if vllm_speculative is not None:
            section = SpeculativeSettings.parse_flag(vllm_speculative)
            overrides["speculative"] = section or {"speculative_method": None}
        for section in _SECTIONS:
            values = section_values(args, section)
            if values:
                overrides.setdefault(section, {}).update(values)
        overrides = merge_overrides(overrides, vllm_overrides(section_values(args, FLAG_GROUP)))
        return base.with_overrides(overrides)


_SECTIONS: dict[str, type[_Section]] = {
    "model": ModelSettings,
    "cache": CacheSettings,
    "parallel": ParallelSettings,
    "scheduler": SchedulerSettings,
    "lora": LoRASettings,
    "speculative": SpeculativeSettings,
}
