"""Configuration dataclasses of the workers: what the engine asks for and what the model is.

`WorkerConfig` is what the engine passes in; `ModelInfo` is what the workers report back once the
model is loaded. `ModelSpec` and `RopeSpec` are the internal, source-independent description of a
Llama-family model, built from either an HF `config.json` or GGUF metadata (see `model_source`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Literal

import torch

from kv_layouts import LAYOUT_NAMES, layout_named
from pagedserve_kernels import kv_quant
from workers.kv_groups import KVGroupLayout, group_layers

SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


class WorkerConfigError(ValueError):
    """A `WorkerConfig` refused, naming the field at fault (the engine's config prefixes its
    section: `cache.block_size`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class WorkerConfig:
    """What the engine asks of the workers (see the README's Workers section for each field).

    The one definition of these knobs' defaults and rules: the engine's config takes its
    fields of the same name's defaults from here (`cluster.engine.config.worker_default`),
    copies their values into one (`EngineConfig.to_worker_config`) and reports this class's
    refusals as its own, so a value is checked once, here, whoever builds it."""

    model: str = "default"
    dtype: str = "auto"
    """float32 | bfloat16 | float16 | auto: `auto` is resolved by `WorkerGroup` for the ranks'
    device (`workers.cpu_features.auto_dtype`); ranks only ever see a concrete dtype (give
    float32 for the exact mode)."""
    block_size: int = 16
    tensor_parallel_size: int = 1
    num_device_blocks: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_cpu_blocks: int | None = None
    swap_space_bytes: int = 256 * 2**20
    max_model_len: int | None = None
    backend: str = "ray"
    weights_cache_dir: str | None = None
    seed: int = 0
    kv_layout: str = "paged"
    """Which `kv_layouts` layout builds the rank's pool (`kv_layouts.LAYOUT_NAMES`)."""
    max_num_seqs: int | None = None
    """The engine's running sequences at most (a layout may size its pool by them: `virtual`
    reserves one slot each); None: not known."""
    device: str = "auto"
    """Where ranks compute: "auto" (CUDA when their bundle holds a GPU), "cpu" or "cuda"."""
    kv_cache_dtype: str = "auto"
    """auto | int8 | fp8 | fp8_e4m3: how the KV pool stores values (`pagedserve_kernels.kv_quant`;
    int8 on CPU ranks, fp8 on CUDA ranks, the paged layout only)."""
    verify_swaps: bool = False
    """Checksum every block copied to the CPU pool and check it when copied back."""
    num_threads: int | str | None = None
    """CPU ranks: torch's intra-op threads, set in the process that runs the rank. "auto" is
    the cores this process may run on, shared among the TP ranks (`cpu_threads`); None leaves
    torch's setting alone (Ray sets OMP_NUM_THREADS from an actor's num_cpus, often 1)."""

    quantized_decode: bool = True
    """CPU ranks: layers loaded from GGUF Q4_1 blocks keep them as 4-bit codes and multiply
    decode-sized calls (`workers.dense_matmul.Q4_MAX_ROWS`: with AVX-512 8 rows in bfloat16, 16
    in float32; with AVX2 32 and 16) with them: the exact checkpoint weights, 0.75 bytes per
    weight read instead of 2 or 4. Off: every product uses the `dtype` weights
    (`workers.dense_matmul`)."""
    quantized_activations: bool | Literal["auto"] = "auto"
    """CPU ranks: every product on a GGUF file's codes (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K)
    quantizes its activations to int8 per row-block of 32 and multiplies the codes with integer
    dot products (`pagedserve_kernels.quant_dot_cpu`, AVX2 or better), in the native decoder
    stack's decode steps as in every other call. Faster, not float32-exact
    (docs/quantized_activations.md). "auto" follows `dtype: auto`
    (`workers.cpu_features.auto_quantized_activations`: on where auto picks float32 on a CPU,
    off with any dtype given); `WorkerGroup` resolves it, so ranks only ever see a bool."""

    max_loras: int = 0
    """LoRA device slots per rank (0: LoRA off, no slot memory allocated). Not the engine's
    `lora.max_loras`, which only counts once `lora.enable_lora` is on: the engine passes that,
    or 0."""
    max_lora_rank: int = 64
    """The largest adapter rank accepted; slots pad every adapter's rank to it."""
    enable_expert_parallel: bool = False
    """Mixture of experts: whole experts per rank instead of every expert's columns split."""
    disable_hybrid_kv_cache_manager: bool = False
    """vLLM's flag: keep every layer's blocks for every sequence even when the model has
    sliding-window layers (else their layers form KV groups that drop the blocks their
    window has passed, `workers.kv_groups`)."""

    def __post_init__(self) -> None:
        """The one check of every worker knob; each refusal names its field (`field`)."""
        for field_name, problem in self._problems():
            raise WorkerConfigError(field_name, problem)

    def _problems(self) -> Iterator[tuple[str, str]]:
        if self.max_loras < 0:
            yield "max_loras", f"max_loras must be >= 0, got {self.max_loras}"
        if self.max_lora_rank <= 0:
            yield "max_lora_rank", f"max_lora_rank must be positive, got {self.max_lora_rank}"
        if self.kv_layout not in LAYOUT_NAMES:
            yield "kv_layout", f"kv_layout {self.kv_layout!r} is not one of {list(LAYOUT_NAMES)}"
        if self.dtype != "auto" and self.dtype not in SUPPORTED_DTYPES:
            yield (
                "dtype",
                f"dtype {self.dtype!r} is not 'auto' or one of {sorted(SUPPORTED_DTYPES)}",
            )
        if self.kv_cache_dtype not in kv_quant.KV_CACHE_DTYPES:
            yield (
                "kv_cache_dtype",
                f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of "
                f"{list(kv_quant.KV_CACHE_DTYPES)}",
            )
        if self.quantized_activations not in (True, False, "auto"):
            yield (
                "quantized_activations",
                f"quantized_activations must be true, false or 'auto', got "
                f"{self.quantized_activations!r}",
            )
        if self.device not in ("auto", "cpu", "cuda"):
            yield "device", f"device {self.device!r} is not 'auto', 'cpu' or 'cuda'"
        if self.backend not in ("ray", "local"):
            yield "backend", f"backend {self.backend!r} is not 'ray' or 'local'"
        positive = {
            "block_size": self.block_size,
            "tensor_parallel_size": self.tensor_parallel_size,
            "num_device_blocks": self.num_device_blocks,
            "kv_cache_bytes": self.kv_cache_bytes,
            "max_model_len": self.max_model_len,
        }
        for name, value in positive.items():
            if value is not None and value <= 0:
                yield name, f"{name} must be positive, got {value}"
        if self.backend == "local" and self.tensor_parallel_size != 1:
            yield (
                "tensor_parallel_size",
                "backend 'local' runs one in-process rank: tensor_parallel_size must be 1",
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            yield (
                "gpu_memory_utilization",
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
            )
        if self.num_cpu_blocks is not None and self.num_cpu_blocks < 0:
            yield "num_cpu_blocks", f"num_cpu_blocks must be >= 0, got {self.num_cpu_blocks}"
        if self.swap_space_bytes < 0:
            yield "swap_space_bytes", f"swap_space_bytes must be >= 0, got {self.swap_space_bytes}"
        threads = self.num_threads
        if threads is not None and threads != "auto":
            if isinstance(threads, bool) or not isinstance(threads, int):
                yield "num_threads", f"num_threads must be 'auto' or an int, got {threads!r}"
            elif threads <= 0:
                yield "num_threads", f"num_threads must be positive, got {threads}"

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            raise ValueError("dtype 'auto' is resolved by WorkerGroup before the ranks start")
        return SUPPORTED_DTYPES[self.dtype]

    def kv_storage_dtype(self, device: torch.device) -> torch.dtype:
        """The KV pool's dtype on `device`; raises WorkerConfigError for a quantized cache the
        device has no kernels for (int8: CPU; fp8: CUDA)."""
        name = kv_quant.canonical(self.kv_cache_dtype)
        wanted = {"int8": "cpu", "fp8_e4m3": "cuda"}.get(name)
        if wanted is not None and device.type != wanted:
            raise WorkerConfigError(
                "kv_cache_dtype",
                f"kv_cache_dtype {self.kv_cache_dtype!r} runs on {wanted.upper()} ranks; "
                f"this rank computes on {device.type}",
            )
        return kv_quant.storage_dtype(name, self.torch_dtype)

    def kv_group_layout(self, layer_sliding_windows: tuple[int | None, ...]) -> KVGroupLayout:
        """How the pool's layers are grouped for a model of these per-layer windows: hybrid
        groups when a layer has a window (unless disabled), else one group of every layer.
        Hybrid groups need a layout that groups layers (`KVLayout.groups_layers`: 'paged'):
        WorkerConfigError otherwise, naming the flag that turns them off."""
        layout = group_layers(
            layer_sliding_windows, enabled=not self.disable_hybrid_kv_cache_manager
        )
        if layout.hybrid and not layout_named(self.kv_layout).groups_layers:
            raise WorkerConfigError(
                "disable_hybrid_kv_cache_manager",
                f"kv_layout {self.kv_layout!r} keeps every layer's blocks, but this model has "
                "sliding-window layers whose hybrid KV groups need kv_layout 'paged': set "
                "disable_hybrid_kv_cache_manager (--disable-hybrid-kv-cache-manager) or use "
                "kv_layout 'paged'",
            )
        return layout

    def cpu_threads(self) -> int | None:
        """The intra-op thread count a CPU rank sets (None: leave torch's). "auto": the cores
        this process may run on (its affinity, not Ray's OMP_NUM_THREADS), divided among the
        tensor-parallel ranks, at least one."""
        if self.num_threads is None:
            return None
        if self.num_threads == "auto":
            return max(1, available_cores() // self.tensor_parallel_size)
        return int(self.num_threads)


def available_cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding settings. `kind` is one of default, linear, llama3, yarn, longrope.

    `partial_rotary_factor` < 1 rotates only the first `int(head_dim * factor)` dimensions of
    each head (`workers.partial_rotary`). longrope divides the frequencies by `short_factor` at
    positions below `original_max_position_embeddings` and by `long_factor` from there on.

    Invariant: fields a kind does not use keep their defaults, so `canonical()` is the same text
    for the same effective rope whatever source (GGUF or HF) it was read from.
    """

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    partial_rotary_factor: float = 1.0

    def rotary_dim(self, head_dim: int) -> int:
        """How many leading dimensions of a head rotate (all of them unless partial)."""
        return int(head_dim * self.partial_rotary_factor)

    def canonical(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


@dataclass(frozen=True)
class ModelVariant:
    """How a family's decoder departs from Llama's; the defaults are Llama's.

    Each family (`workers.families`) reads its fields from the HF config or GGUF metadata; the
    model's layers follow them without asking which family they belong to.
    """

    qk_norm: bool = False
    """An RMS norm over each query and key head before the rotary embedding."""
    norm_offset: float = 0.0
    """Added to every RMS norm weight at load (Gemma's checkpoints store `w` for `1 + w`)."""
    sandwich_norms: bool = False
    """Norms after attention and around the MLP too (`post_attention_layernorm` is then the
    attention output's norm, `pre_feedforward_layernorm` the MLP input's)."""
    activation: str = "silu"
    """The gated MLP's activation of the gate: silu or gelu_tanh."""
    embedding_multiplier: float = 1.0
    """The embedded tokens are multiplied by it (Gemma: sqrt(hidden_size))."""
    query_pre_attn_scalar: float | None = None
    """Attention scale `query_pre_attn_scalar ** -0.5` (None: `head_dim ** -0.5`)."""
    attention_softcap: float | None = None
    """Attention scores become `cap * tanh(scores / cap)` before the softmax (None: not)."""
    final_softcap: float | None = None
    """Logits become `cap * tanh(logits / cap)` (None: not)."""
    output_bias: bool | None = None
    """Whether `o_proj` has a bias (None: as the q/k/v projections, `attention_bias`)."""
    layer_ropes: tuple[RopeSpec, ...] = ()
    """Layer i's rotary settings where layers differ (empty: every layer uses `rope`)."""
    num_experts: int = 0
    """Mixture of experts: experts per layer (0: a dense MLP, `workers.moe`)."""
    experts_per_token: int = 0
    norm_topk_prob: bool = True
    """Whether a token's top-k router weights are renormalized to sum to one."""
    expert_intermediate_size: int = 0
    """An expert's intermediate size (0: `intermediate_size`)."""

    @property
    def is_default(self) -> bool:
        return self == ModelVariant()


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, independent of where its weights come from.

    `layer_sliding_windows[i]` is layer i's sliding window in tokens (None: full attention);
    `variant` says how the family departs from Llama's layer (defaults: not at all).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeSpec
    attention_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    layer_sliding_windows: tuple[int | None, ...]
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    variant: ModelVariant = ModelVariant()

    def __post_init__(self) -> None:
        sizes = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
        }
        for name, value in sizes.items():
            if value <= 0:
                raise ValueError(f"model config: {name} must be positive")
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(
                f"model config: head_dim must be positive and even, got {self.head_dim}"
            )
        if len(self.layer_sliding_windows) != self.num_layers:
            raise ValueError("model config: one sliding-window entry per layer is required")
        if self.variant.layer_ropes and len(self.variant.layer_ropes) != self.num_layers:
            raise ValueError("model config: one rope entry per layer is required")

    def layer_rope(self, index: int) -> RopeSpec:
        """Layer `index`'s rotary settings."""
        return self.variant.layer_ropes[index] if self.variant.layer_ropes else self.rope

    @property
    def sliding_window(self) -> int | None:
        windows = [w for w in self.layer_sliding_windows if w is not None]
        return max(windows) if windows else None


@dataclass(frozen=True)
class ModelInfo:
    """What the workers report about the loaded model (the engine sizes and identifies with it)."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    weights_digest: str
    dtype: str
    rope: str
    quantization: str
    kv_bytes_per_block: int
    kv_cache_dtype: str = "auto"
    """How the KV cache stores values (`kv_quant.canonical`: auto, int8, fp8_e4m3); in the
    cache identity, so blocks of one never serve a request of another."""
    quantized_activations: bool = False
    """Whether the products take int8-quantized activations (it changes KV values, so it is in
    the cache identity)."""
    kv_group_windows: tuple[int | None, ...] = ()
    """Hybrid KV groups (`workers.kv_groups`): each group's sliding window (None: full
    attention), in the workers' group order; empty when every layer keeps every block.
    `kv_bytes_per_block` is then one group's block (`KVGroupLayout.slots` layers)."""
