"""The decoder of every family we run (Llama's layer, as `ModelSpec.variant` varies it) over a
paged KV cache.

Attention metadata travels explicitly in `AttentionMetadata`; KV is written and read only through
the `pagedserve_kernels` public API. Tensor parallelism lives in the parallel layers alone: query/KV
heads and MLP columns are split by rank, `o_proj` and `down_proj` all-reduce, and the vocab-parallel
embedding and LM head all-reduce / all-gather.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedserve_kernels import AttentionStep, PagedAttentionStep, prepare_attention
from pagedserve_kernels.decoder_stack_cpu import StackLayer, StackShape
from workers.checkpoint import CheckpointReader
from workers.config import ModelSpec
from workers.decoder_stack import NativeDecode, NativeStack
from workers.kv_groups import full_layout
from workers.layer_ops import LayerOps, NativeCpuLayerOps, layer_ops_for
from workers.layers import (
    ColumnParallelLinear,
    RMSNorm,
    RowParallelLinear,
    RowSegment,
    VocabParallelEmbedding,
)
from workers.lora.apply import LoRAStep
from workers.moe import SparseMoE
from workers.parallel import TensorParallel, even_range, head_layout
from workers.rope import RotaryEmbedding


@dataclass
class AttentionMetadata:
    """One step's packed batch. Tokens are packed by sequence in `cu_query_lens` order.

    positions / slot_mapping: [tokens] int64; cu_query_lens: [seqs + 1] int32; context_lens:
    [seqs] int32 (cached tokens including this step's); block_tables: [seqs, max_blocks] int32;
    logits_indices: [rows] int64, the token rows whose logits the caller wants.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cu_query_lens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    logits_indices: torch.Tensor
    group_tables: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """Hybrid KV groups (`workers.kv_groups`): (slot_mapping, block_tables) of groups 1, 2,
    ... (`slot_mapping` and `block_tables` above are group 0's); empty with one group."""

    def prepare_kernels(self, kv_pool: torch.Tensor) -> AttentionStep:
        """Validate this step's metadata once for every layer of `kv_pool` (ValueError if bad)."""
        prepared = prepare_attention(
            self.cu_query_lens,
            self.context_lens,
            self.block_tables,
            num_blocks=kv_pool.shape[2],
            block_size=kv_pool.shape[3],
            slot_mapping=self.slot_mapping,
            device=kv_pool.device,
        )
        return PagedAttentionStep(prepared)

    def group_steps(self, kv_pool: torch.Tensor, num_groups: int) -> list[AttentionStep]:
        """One prepared step per KV group, each over its group's slots and tables (a plan
        without per-group tables, such as the profiling pass, uses group 0's for all)."""
        first = self.prepare_kernels(kv_pool)
        if not self.group_tables:
            return [first] * num_groups
        steps = [first]
        for slot_mapping, block_tables in self.group_tables:
            prepared = prepare_attention(
                self.cu_query_lens,
                self.context_lens,
                block_tables,
                num_blocks=kv_pool.shape[2],
                block_size=kv_pool.shape[3],
                slot_mapping=slot_mapping,
                device=kv_pool.device,
            )
            steps.append(PagedAttentionStep(prepared))
        return steps


class Attention(torch.nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        layer_index: int,
        tp: TensorParallel,
        dtype: torch.dtype,
        ops: LayerOps,
    ) -> None:
        super().__init__()
        self.ops = ops
        layout = head_layout(spec, tp)
        d = spec.head_dim
        self.layer_index = layer_index
        self.head_dim = d
        self.num_q = layout.num_q
        self.num_kv = layout.num_kv
        self.sliding_window = spec.layer_sliding_windows[layer_index]
        variant = spec.variant
        scalar = variant.query_pre_attn_scalar
        self.scale = d**-0.5 if scalar is None else scalar**-0.5
        self.softcap = variant.attention_softcap
        self.q_norm = self.k_norm = None
        if variant.qk_norm:  # one weight per head dimension, shared by the heads
            self.q_norm = RMSNorm(d, spec.rms_norm_eps, dtype, variant.norm_offset)
            self.k_norm = RMSNorm(d, spec.rms_norm_eps, dtype, variant.norm_offset)
        q_rows, kv_rows = spec.num_heads * d, spec.num_kv_heads * d
        q_span = (layout.q_start * d, (layout.q_start + layout.num_q) * d)
        kv_span = (layout.kv_start * d, (layout.kv_start + layout.num_kv) * d)
        self.qkv_proj = ColumnParallelLinear(
            spec.hidden_size,
            [
                RowSegment("q_proj", q_rows, *q_span),
                RowSegment("k_proj", kv_rows, *kv_span),
                RowSegment("v_proj", kv_rows, *kv_span),
            ],
            spec.attention_bias,
            dtype,
        )
        self.o_proj = RowParallelLinear(
            q_rows,
            spec.hidden_size,
            q_span,
            spec.attention_bias if variant.output_bias is None else variant.output_bias,
            tp,
            dtype,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        step: AttentionStep,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        lora: LoRAStep | None = None,
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if lora is not None:
            lora.column(self.layer_index, "qkv", hidden, qkv)
        heads = (self.num_q, self.num_kv, self.head_dim)
        if self.q_norm is not None:
            qkv = self._norm_query_key_heads(qkv)
        q = self.ops.rotary_write_kv(qkv, heads, cos_sin, step, k_cache, v_cache)
        window = self.sliding_window
        if self.softcap is None:
            out = step.attend(q, k_cache, v_cache, scale=self.scale, sliding_window=window)
        else:
            out = step.attend(
                q, k_cache, v_cache, scale=self.scale, sliding_window=window, softcap=self.softcap
            )
        attended = out.reshape(tokens, self.num_q * self.head_dim)
        projected = self.o_proj(attended)
        if lora is not None:
            lora.row(self.layer_index, "o", attended, projected)
        return projected

    def _norm_query_key_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """The fused QKV rows with each query and key head RMS-normed (values as they are)."""
        assert self.q_norm is not None and self.k_norm is not None
        tokens, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([self.num_q * d, self.num_kv * d, self.num_kv * d], dim=-1)
        q = self.q_norm(q.reshape(tokens, self.num_q, d)).reshape(tokens, -1)
        k = self.k_norm(k.reshape(tokens, self.num_kv, d)).reshape(tokens, -1)
        return torch.cat((q, k, v.to(q.dtype)), dim=-1)

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        """Load this rank's projections (and head norms) from `<prefix>` (`...self_attn.`)."""
        self.qkv_proj.load(reader, prefix)
        self.o_proj.load(reader, f"{prefix}o_proj")
        if self.q_norm is not None and self.k_norm is not None:
            self.q_norm.load(reader, f"{prefix}q_norm.weight")
            self.k_norm.load(reader, f"{prefix}k_norm.weight")


class GatedMLP(torch.nn.Module):
    """down(act(gate(x)) * up(x)), gate/up column-parallel (fused), down row-parallel; `act` is
    silu or gelu with the tanh approximation (`ModelVariant.activation`)."""

    def __init__(
        self,
        spec: ModelSpec,
        layer_index: int,
        tp: TensorParallel,
        dtype: torch.dtype,
        ops: LayerOps,
    ) -> None:
        super().__init__()
        self.ops = ops
        self.layer_index = layer_index
        full = spec.intermediate_size
        start, stop = even_range(full, tp)
        self.gate_up_proj = ColumnParallelLinear(
            spec.hidden_size,
            [RowSegment("gate_proj", full, start, stop), RowSegment("up_proj", full, start, stop)],
            spec.mlp_bias,
            dtype,
        )
        self.down_proj = RowParallelLinear(
            full, spec.hidden_size, (start, stop), spec.mlp_bias, tp, dtype
        )
        self.gelu = spec.variant.activation == "gelu_tanh"

    def forward(self, x: torch.Tensor, lora: LoRAStep | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            lora.column(self.layer_index, "gate_up", x, gate_up)
        if self.gelu:
            gate, up = gate_up.chunk(2, dim=-1)
            activated = F.gelu(gate, approximate="tanh") * up
        else:
            activated = self.ops.silu_mul(gate_up)
        down = self.down_proj(activated)
        if lora is not None:
            lora.row(self.layer_index, "down", activated, down)
        return down

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        self.gate_up_proj.load(reader, prefix)
        self.down_proj.load(reader, f"{prefix}down_proj")


class DecoderLayer(torch.nn.Module):
    """Pre-norm attention and MLP blocks around the residual stream.

    Llama's layer norms the attention's output and the MLP's input together
    (`post_attention_layernorm`, folded into the residual add). With
    `ModelVariant.sandwich_norms` (Gemma) the attention and MLP outputs are normed too before
    they join the stream (`post_attention_layernorm`, `post_feedforward_layernorm`), and the
    MLP's input norm is `pre_feedforward_layernorm`.

    The MLP's output is not added here but handed on as the next block's pending `delta`, so
    that the add and the next norm are one `LayerOps.add_norm`."""

    def __init__(
        self,
        spec: ModelSpec,
        layer_index: int,
        tp: TensorParallel,
        dtype: torch.dtype,
        ops: LayerOps,
    ) -> None:
        super().__init__()
        self.ops = ops
        offset, eps = spec.variant.norm_offset, spec.rms_norm_eps
        self.input_layernorm = RMSNorm(spec.hidden_size, eps, dtype, offset)
        self.self_attn = Attention(spec, layer_index, tp, dtype, ops)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps, dtype, offset)
        self.mlp: GatedMLP | SparseMoE = (
            SparseMoE(spec, layer_index, tp, dtype)
            if spec.variant.num_experts
            else GatedMLP(spec, layer_index, tp, dtype, ops)
        )
        self.sandwich = spec.variant.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(spec.hidden_size, eps, dtype, offset)
            self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, eps, dtype, offset)

    def forward(
        self,
        hidden: torch.Tensor,
        delta: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        step: AttentionStep,
        kv_layer: torch.Tensor,
        lora: LoRAStep | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer over the residual stream `hidden + delta` (`delta` None: `hidden`);
        returns the new stream as (residual, the MLP's output still to be added)."""
        hidden, normed = self.ops.add_norm(hidden, delta, self.input_layernorm)
        attended = self.self_attn(normed, cos_sin, step, kv_layer[0], kv_layer[1], lora)
        if not self.sandwich:
            hidden, normed = self.ops.add_norm(hidden, attended, self.post_attention_layernorm)
            return hidden, self.mlp(normed, lora)
        attended = self.post_attention_layernorm(attended)
        hidden, normed = self.ops.add_norm(hidden, attended, self.pre_feedforward_layernorm)
        return hidden, self.post_feedforward_layernorm(self.mlp(normed, lora))

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        self.input_layernorm.load(reader, f"{prefix}input_layernorm.weight")
        self.post_attention_layernorm.load(reader, f"{prefix}post_attention_layernorm.weight")
        self.self_attn.load(reader, f"{prefix}self_attn.")
        self.mlp.load(reader, f"{prefix}mlp.")
        if self.sandwich:
            self.pre_feedforward_layernorm.load(reader, f"{prefix}pre_feedforward_layernorm.weight")
            self.post_feedforward_layernorm.load(
                reader, f"{prefix}post_feedforward_layernorm.weight"
            )

    def stack_layer(self) -> StackLayer | None:
        """This layer as one layer of the native decoder stack
        (`pagedserve_kernels.decoder_stack_cpu`), or None where the stack does not compute it:
        sandwich norms, experts, a product with neither int8 panels nor its exact 4-bit copy,
        or a bias. Each product takes the copy the per-operator path multiplies on (panels
        first, see `DenseMatmul.__call__`)."""
        if self.sandwich or not isinstance(self.mlp, GatedMLP):
            return None
        attention, mlp = self.self_attn, self.mlp
        linears = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(linear.bias is not None for linear in linears):
            return None
        weights = [
            linear.matmul.panels if linear.matmul.panels is not None else linear.matmul.q4
            for linear in linears
        ]
        qkv, out, gate_up, down = weights
        if qkv is None or out is None or gate_up is None or down is None:
            return None
        return StackLayer(
            input_norm=self.input_layernorm.weight.detach(),
            qkv=qkv,
            out=out,
            post_norm=self.post_attention_layernorm.weight.detach(),
            gate_up=gate_up,
            down=down,
            window=attention.sliding_window,
        )


class CausalLM(torch.nn.Module):
    """One rank's shard of the model: `forward` gives hidden states, `logits` the full vocab.

    In float32 every tensor is float32. In a reduced dtype (bfloat16, float16) the layers' weights
    and matmuls are in that dtype, but the residual stream between layers, the final norm and the
    LM head (its own float32 copy of the weights, even when tied to the embedding) stay float32:
    rounding errors do not accumulate over the layers and the logits are not rounded. That LM
    head screens in bfloat16 and recomputes in float32 every logit that could be a row's
    maximum (`workers.lm_head.ScreenedHead`), so its greedy choice is the float32 head's.

    With `quantized_decode` (on CPU), layers whose checkpoint values are exactly GGUF Q4_1 blocks
    also keep them as 4-bit codes and multiply decode-sized calls with them
    (`workers.dense_matmul`). When every layer has them, steps of decodes only run the whole
    stack in one native call (`workers.decoder_stack`, same bits as the 4-bit products here).
    An LM head stored as exact Q8_0 blocks multiplies a few rows on its 8-bit codes
    (`VocabParallelEmbedding.keep_exact_q8`): float32 logits over the exact weights.
    With `quantized_activations` (off by default; not float32-exact) the products those copies
    do not take (prefill, larger batches) multiply the same codes with int8-quantized activations
    (`pagedserve_kernels.quant_dot_cpu`, docs/quantized_activations.md).
    """

    def __init__(
        self,
        spec: ModelSpec,
        tp: TensorParallel,
        dtype: torch.dtype,
        quantized_decode: bool = True,
        quantized_activations: bool = False,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.tp = tp
        self.reduced = dtype != torch.float32
        self.ops = layer_ops_for(torch.empty(0).device)  # the device being built on
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, tp, dtype)
        variant = spec.variant
        self.layers = torch.nn.ModuleList(
            DecoderLayer(spec, i, tp, dtype, self.ops) for i in range(spec.num_layers)
        )
        head_dtype = torch.float32 if self.reduced else dtype
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, head_dtype, variant.norm_offset)
        self.lm_head = (
            self.embed_tokens
            if spec.tie_word_embeddings and not self.reduced
            else VocabParallelEmbedding(
                spec.vocab_size, spec.hidden_size, tp, head_dtype, screened=self.reduced
            )
        )
        ropes = [spec.layer_rope(index) for index in range(spec.num_layers)]
        distinct = list(dict.fromkeys([spec.rope, *ropes]))
        self.rotaries = torch.nn.ModuleList(RotaryEmbedding(r, spec.head_dim) for r in distinct)
        """Each distinct rope of the layers; the first is `spec.rope` (the native stack's)."""
        self.layer_rotary = [distinct.index(rope) for rope in ropes]
        """Layer i's index into `rotaries`."""
        self.kv_groups = full_layout(spec.num_layers)
        """Which pool row and group step each layer uses (the rank sets its layout)."""
        self.native_decode: NativeDecode | None = None
        """Set by `load` where the whole stack runs natively (None: per-operator only)."""
        self.quantized_decode = quantized_decode
        self.quantized_activations = quantized_activations
        for module in self.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.matmul.quantized_decode = quantized_decode
                module.matmul.quantized_activations = quantized_activations

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        metadata: AttentionMetadata,
        kv_pool: torch.Tensor,
        lora: LoRAStep | None = None,
    ) -> torch.Tensor:
        """Hidden states `[tokens, hidden]` after the final norm; writes this step's KV.
        `lora`: the step's adapters, added after every adapted base linear (None: none)."""
        hidden = self.embed_tokens.embed(token_ids)
        multiplier = self.spec.variant.embedding_multiplier
        if multiplier != 1.0:
            hidden = hidden * torch.tensor(multiplier, dtype=hidden.dtype)
        cos_sins = [
            self.ops.cos_sin(rotary, metadata.positions, hidden.dtype) for rotary in self.rotaries
        ]
        cos_sin = cos_sins[0]
        if self.reduced:
            hidden = hidden.to(torch.float32)  # the residual stream
        groups = self.kv_groups
        steps = metadata.group_steps(kv_pool, groups.num_groups)  # validated once per group
        if self.native_decode is not None and lora is None and groups.num_groups == 1:
            stacked = self.native_decode.forward(hidden, cos_sin, steps[0], kv_pool)
            if stacked is not None:
                return stacked
        delta = None
        for index, layer in enumerate(self.layers):
            rotary = cos_sins[self.layer_rotary[index]]
            step, row = steps[groups.layer_group[index]], kv_pool[groups.layer_slot[index]]
            hidden, delta = layer(hidden, delta, rotary, step, row, lora)
        return self.ops.add_norm(hidden, delta, self.norm)[1]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits `[rows, vocab]` of the given hidden rows (identical on every rank)."""
        logits = self.lm_head.logits(hidden).to(torch.float32)
        cap = self.spec.variant.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @torch.inference_mode()
    def load(self, reader: CheckpointReader) -> None:
        """Load this rank's shard; raises ValueError naming any missing or mis-shaped tensor."""
        self.embed_tokens.load(reader, "model.embed_tokens.weight")
        for index, layer in enumerate(self.layers):
            layer.load(reader, f"model.layers.{index}.")
        self.norm.load(reader, "model.norm.weight")
        if not self.spec.tie_word_embeddings:
            self.lm_head.load(reader, "lm_head.weight")
        elif self.lm_head is not self.embed_tokens:
            self.lm_head.load(reader, "model.embed_tokens.weight")
        for module in self.modules():  # the weights are final: prepack them where it pays
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.matmul.pack()
        if self.lm_head.screen is None:  # float32: the head's plain product, packed
            self.lm_head.head_matmul.pack()
        if self.quantized_decode or self.quantized_activations:
            self.lm_head.keep_exact_q8(self.quantized_decode, self.quantized_activations)
        self.native_decode = NativeDecode.build(self.native_stack())

    def native_stack(self) -> NativeStack | None:
        """The whole stack as the native decoder stack takes it, or None where it cannot run
        it: Llama's layer only (`ModelVariant` at its defaults), on one rank, with the native
        layer ops, and every layer one it computes (`DecoderLayer.stack_layer`)."""
        usable = (
            isinstance(self.ops, NativeCpuLayerOps)
            and self.tp.world_size == 1
            and len(self.layers) > 0
            and self.spec.variant.is_default
        )
        if not usable:
            return None
        layers = [layer.stack_layer() for layer in self.layers]
        if any(layer is None for layer in layers):
            return None
        first = self.layers[0]
        attention = first.self_attn
        assert isinstance(first.mlp, GatedMLP)
        shape = StackShape(
            hidden=self.spec.hidden_size,
            num_q=attention.num_q,
            num_kv=attention.num_kv,
            head_dim=attention.head_dim,
            intermediate=first.mlp.down_proj.weight.shape[1],
            eps=self.norm.eps,
            scale=attention.scale,
        )
        kept = [layer for layer in layers if layer is not None]
        return NativeStack(kept, shape, self.norm.weight.detach())
