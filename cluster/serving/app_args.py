"""The `args` of the Serve application, validated when the app is built (pydantic at the edge).

`engine` is `cluster.engine.config.EngineConfig` as a mapping, validated by `engine_config()`.
`api_keys` maps each key to its tenant, either as a plain tenant name or as
`{"tenant": ..., "admin": true}`; only admin keys may load and unload LoRA adapters at run time.
`lora_modules` and `allow_runtime_lora_updating` are the LoRA serving settings
(cluster/serving/lora_args.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster.engine.config import EngineConfig
from cluster.engine.lora_request import LoRARequest
from cluster.serving.limits import LimitsArgs
from cluster.serving.lora_args import LoRAModuleArgs, check_unique, normalise_lora_modules

DEPLOYMENT_NAME = "GenerationServer"
"""The engine deployment's name (`cluster.serving.engine_server`), also its key in a Serve
config (`pagedserve serve` edits that deployment's options by it)."""


class DirectoryArgs(BaseModel):
    """The KV directory: the application's cluster-wide prefix index (kv_directory.py)."""

    model_config = ConfigDict(extra="forbid")

    max_entries: int = Field(
        1_000_000, ge=1, description="block hashes indexed at most (least recently used go first)"
    )
    publish_period_s: float = Field(
        0.05, gt=0, le=10, description="how often an engine replica sends its block events"
    )
    replica_timeout_s: float = Field(
        10.0, gt=0, description="a replica silent this long is dropped with its entries"
    )
    query_timeout_s: float = Field(
        0.25, gt=0, description="a routing query slower than this answers nothing (load only)"
    )


class KVTransferArgs(BaseModel):
    """Peer pull: a replica lacking a request's leading blocks copies them from the replica the
    KV directory says holds them, when that is predicted faster than computing them."""

    model_config = ConfigDict(extra="forbid")

    pull: bool = Field(True, description="pull missing prefixes from peers (export stays on)")
    timeout_s: float = Field(10.0, gt=0, description="a slower pull is computed instead")
    min_blocks: int = Field(1, ge=1, description="fewer missing blocks are computed unasked")
    use_cost_model: bool = Field(
        True, description="false: pull whenever a peer holds more, whatever the measured costs"
    )
    bandwidth_prior_bytes_per_s: float = Field(
        1e9, gt=0, description="assumed bandwidth to a peer until a pull measured it"
    )


class HealthArgs(BaseModel):
    """When a replica reports itself unhealthy."""

    model_config = ConfigDict(extra="forbid")

    stuck_after_s: float = Field(
        60.0, gt=0, description="an engine with work whose step count has not moved this long"
    )


class ApiKeyArgs(BaseModel):
    """An API key's tenant, and whether the key is an administrator's (may load and unload LoRA
    adapters at run time)."""

    model_config = ConfigDict(extra="forbid")

    tenant: str = Field(min_length=1)
    admin: bool = False


DEFAULT_SHUTDOWN_GRACE_S = 25.0
"""Kubernetes' default termination grace period (30 s) less a margin for stopping Serve and Ray:
a pod's `terminationGracePeriodSeconds` must exceed the grace period (helm/pagedserve)."""


class ShutdownArgs(BaseModel):
    """What `pagedserve serve` does on SIGINT/SIGTERM (cluster/serving/serve_runner.py)."""

    model_config = ConfigDict(extra="forbid")

    grace_s: float = Field(
        DEFAULT_SHUTDOWN_GRACE_S,
        ge=0,
        le=3600,
        description="seconds from the signal to the exit: in-flight requests may run on for "
        "all but the last few (serve_runner.STOP_RESERVE_S), then end with an error event "
        "(new requests are refused at once)",
    )


class ServeAppArgs(BaseModel):
    """The `args` of the Serve application (validated when the app is built)."""

    model_config = ConfigDict(extra="forbid")

    served_model_name: str = Field("SmolLM2-135M-Instruct", min_length=1)
    engine: dict[str, Any] = Field(
        default_factory=dict, description="cluster.engine.config.EngineConfig"
    )
    api_keys: dict[str, ApiKeyArgs] = Field(
        default_factory=dict,
        description="API key -> tenant name (or {tenant, admin}); empty: no authentication and "
        "one shared tenant",
    )
    lora_modules: list[LoRAModuleArgs] = Field(
        default_factory=list,
        description="LoRA adapters every engine replica serves from start: {name: path}, or "
        'vLLM\'s [{name, path, base_model_name}]; clients select one with "model": name',
    )
    allow_runtime_lora_updating: bool = Field(
        False,
        description="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (admin keys "
        "only when API keys are configured); off: both answer 404",
    )

    stream_interval: int = Field(
        1,
        ge=1,
        description="new tokens per streamed chunk once the first token is out (vLLM's and "
        "SGLang's --stream-interval): 1 streams every token; N > 1 sends fewer, larger "
        "chunks, each crossing from the engine replica to the client once; the first token "
        "and the final chunk are never held back",
    )
    stream_chunks_per_step: int | None = Field(
        None,
        ge=1,
        description="with C set, a chunk also waits for ceil(running sequences / C) new tokens, "
        "so an engine replica sends about C chunks per decode step however full its batch is: "
        "light load streams every stream_interval tokens, a saturated batch in larger chunks "
        "(each chunk's hops cost CPU beside the forward pass on a small machine); unset: "
        "stream_interval alone",
    )

    enable_auto_tool_choice: bool = Field(
        True,
        description="vLLM's --enable-auto-tool-choice, on by default (as llama-server --jinja "
        'and Ollama answer tools): tool_choice "auto", OpenAI\'s default with tools, reads '
        "calls out of the model's text; off: such requests get a 400",
    )
    tool_call_parser: Literal["hermes", "llama3_json"] | None = Field(
        None,
        description="vLLM's --tool-call-parser: how the model writes tool calls; unset: the "
        "parser that fits the model's chat template (hermes for templates with <tool_call> "
        "and for the fallback used by templates without tools, llama3_json for Llama 3's)",
    )
    reasoning_parser: Literal["qwen3", "deepseek_r1"] | None = Field(
        None,
        description="vLLM's --reasoning-parser: the chat answer's thinking span goes to "
        "reasoning_content (cluster.serving.reasoning_parsers)",
    )

    directory: DirectoryArgs = Field(default_factory=DirectoryArgs)
    kv_transfer: KVTransferArgs = Field(default_factory=KVTransferArgs)
    health: HealthArgs = Field(default_factory=HealthArgs)
    limits: LimitsArgs = Field(default_factory=LimitsArgs)
    shutdown: ShutdownArgs = Field(default_factory=ShutdownArgs)
    shared_prefixes: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list,
        description=(
            "operator-chosen prompt prefixes (e.g. a system prompt, as the rendered prompt "
            "begins) whose whole KV blocks all tenants share; blocks after them stay per tenant"
        ),
    )

    @field_validator("api_keys", mode="before")
    @classmethod
    def _tenant_shorthand(cls, value: Any) -> Any:
        """`{"key": "tenant"}` is `{"key": {"tenant": "tenant"}}`."""
        if not isinstance(value, dict):
            return value
        return {key: {"tenant": v} if isinstance(v, str) else v for key, v in value.items()}

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _lora_module_forms(cls, value: Any) -> Any:
        return normalise_lora_modules(value)

    @model_validator(mode="after")
    def _adapter_names(self) -> ServeAppArgs:
        check_unique(self.lora_modules, self.served_model_name)
        return self

    def engine_config(self) -> EngineConfig:
        """The engine section, validated; `lora_modules` or `allow_runtime_lora_updating` turn
        `lora.enable_lora` on."""
        config = EngineConfig.build(self.engine)
        if (self.lora_modules or self.allow_runtime_lora_updating) and not config.lora.enable_lora:
            config = config.with_overrides({"lora": {"enable_lora": True}})
        return config

    def tenants_by_key(self) -> dict[str, str]:
        return {key: value.tenant for key, value in self.api_keys.items()}

    def admin_keys(self) -> frozenset[str]:
        return frozenset(key for key, value in self.api_keys.items() if value.admin)

    def configured_adapters(self) -> list[LoRARequest]:
        """`lora_modules` as the engine's requests, ids 1..n in the order given."""
        return [
            LoRARequest(
                module.name,
                index,
                module.path,
                module.base_model_name or self.served_model_name,
            )
            for index, module in enumerate(self.lora_modules, start=1)
        ]
