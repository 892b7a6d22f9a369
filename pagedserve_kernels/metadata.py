"""Per-step attention metadata, validated once and shared by every layer of the step.

``prepare_attention`` runs the value checks of ``paged_attention`` and ``write_kv`` (packing,
lengths, block ids, slots) once, and precomputes what the CPU path needs every layer: the query
rows of the native kernel and the slots to write; the torch path's decode groups (which
sequences are attended together, their gather indices and key masks) and prefill chunks' block
ids are built on the first layer that asks for them. A call with ``metadata=`` then checks only
cheap shape, dtype and device facts, so a model with L layers pays the value checks once per
step, not L times.

Invariants of a ``PreparedAttention`` (established by ``prepare_attention``, never changed): every
block id in ``decode_groups`` and ``prefills`` lies in ``[0, num_blocks)``; every slot in
``write_slots`` lies in ``[0, num_blocks * block_size)`` and appears once (``slot_mapping``: all
slots, -1 kept, ``write_rows``: the rows of the slots >= 0 when some are -1); every token row of a
sequence with one query token is in exactly one decode group and in ``decode_rows``, every other
sequence with query tokens is one prefill entry; every query row is in ``query_rows`` once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from pagedserve_kernels import validation
from pagedserve_kernels.attention_cpu import DecodeRows

DECODE_GROUP_TOKENS = 2048
"""Padded key positions a decode group may gather at most (bounds the gather buffer)."""

MIN_PADDING_TOKENS = 64
"""A decode joins a group when its padding is at most max(this, a quarter of the group width)."""


@dataclass(frozen=True)
class DecodeGroup:
    """Decodes (one query token each) attended in one batched call over a padded gather.

    ``block_ids`` ``[num_seqs * width]``: each sequence's blocks in block-table order (so a
    result never depends on which physical blocks hold the keys), then a valid filler id up to
    ``width``; ``key_bias`` ``[num_seqs, 1, 1, width * block_size]`` (float32, maybe a strided
    view): 0 for a key the token sees, -inf past its context, None when every sequence fills all
    ``width`` blocks. ``context_lens`` ``[num_seqs, 1, 1, 1]``.
    """

    rows: torch.Tensor
    row_range: tuple[int, int] | None
    block_ids: torch.Tensor
    width: int
    context_lens: torch.Tensor
    key_bias: torch.Tensor | None

    @property
    def num_seqs(self) -> int:
        return self.rows.shape[0]


@dataclass(frozen=True)
class PrefillChunk:
    """A sequence with several query tokens: rows ``start..start+q_len`` over its first blocks."""

    start: int
    query_len: int
    context_len: int
    block_ids: torch.Tensor


class GatherWorkspace:
    """Gather buffers and converted key masks reused by every layer of one step (layers run one
    after another).

    A buffer per (dtype, device, block shape) is allocated on first use and kept: the same
    allocation for every layer stays in the CPU cache instead of being page-faulted in again.
    A decode group's float32 key bias is converted to the query's dtype once per step, not once
    per layer (the conversion of its strided view cost more than the gather of a small group).
    """

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._buffers: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self._biases: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def key_bias(self, index: int, group: DecodeGroup, dtype: torch.dtype) -> torch.Tensor | None:
        """``group.key_bias`` (decode group ``index`` of this step) in ``dtype``, contiguous."""
        if group.key_bias is None:
            return None
        found = self._biases.get((index, dtype))
        if found is None:
            found = group.key_bias.to(dtype).contiguous()
            self._biases[(index, dtype)] = found
        return found

    def buffers(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two ``[rows, block_numel]`` buffers (K and V) matching ``cache``'s blocks."""
        key = (cache.dtype, cache.device, tuple(cache.shape[1:]))
        found = self._buffers.get(key)
        if found is None:
            shape = (self.rows, cache[0].numel())
            found = (cache.new_empty(shape), cache.new_empty(shape))
            self._buffers[key] = found
        return found


@dataclass(frozen=True)
class TorchPathPlan:
    """What the plain-torch CPU path reads: the decode groups, the prefill chunks and the gather
    buffers every layer of the step reuses."""

    decode_groups: tuple[DecodeGroup, ...]
    prefills: tuple[PrefillChunk, ...]
    workspace: GatherWorkspace = field(compare=False, repr=False)

    @staticmethod
    def of(
        checked: validation.CheckedLengths, block_size: int, group_tokens: int, device: torch.device
    ) -> TorchPathPlan:
        """The plan of a step on the CPU from its validated lengths."""
        q_lens, ctx = checked.query_lens.tolist(), checked.context_lens.tolist()
        starts = checked.cu_query_lens[:-1].tolist()
        decodes = [seq for seq, q_len in enumerate(q_lens) if q_len == 1]
        groups = _decode_groups(decodes, checked, block_size, group_tokens, device)
        prefills: list[PrefillChunk] = []
        gather_rows = max([0, *(g.block_ids.shape[0] for g in groups)])
        for seq, q_len in enumerate(q_lens):
            if q_len > 1:
                blocks = -(-ctx[seq] // block_size)
                ids = checked.block_tables[seq, :blocks].clone()
                prefills.append(PrefillChunk(starts[seq], q_len, ctx[seq], ids))
                gather_rows = max(gather_rows, blocks)
        return TorchPathPlan(tuple(groups), tuple(prefills), GatherWorkspace(gather_rows))


@dataclass(frozen=True)
class PreparedAttention:
    """Validated metadata of one step; build with ``prepare_attention``.

    The torch path's plan (``decode_groups``, ``prefills``, ``workspace``) is built on first
    use, once per step: a step whose every row the native kernel takes never builds it."""

    num_tokens: int
    num_blocks: int
    block_size: int
    device: torch.device
    query_starts: tuple[int, ...]
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor | None
    write_rows: torch.Tensor | None
    write_slots: torch.Tensor | None
    decode_rows: DecodeRows | None
    """The step's decodes (one query token each) for the native kernels
    (`pagedserve_kernels.attention_cpu`, the decoder stack); None when none."""
    query_rows: DecodeRows | None
    """Every query row of the step (decodes and prefill chunks) for one native kernel call per
    layer, each row as the decode of its own position; None when there is none."""
    checked: validation.CheckedLengths | None = field(compare=False, repr=False)
    """The validated lengths the torch path's plan is built from (CPU steps; else None)."""
    decode_group_tokens: int = DECODE_GROUP_TOKENS

    @functools.cached_property
    def torch_path(self) -> TorchPathPlan:
        """The plain-torch path's plan of this step (empty off the CPU)."""
        if self.checked is None:
            return TorchPathPlan((), (), GatherWorkspace(0))
        return TorchPathPlan.of(
            self.checked, self.block_size, self.decode_group_tokens, self.device
        )

    @property
    def decode_groups(self) -> tuple[DecodeGroup, ...]:
        """Every decode in exactly one group (the torch path's)."""
        return self.torch_path.decode_groups

    @property
    def prefills(self) -> tuple[PrefillChunk, ...]:
        """One entry per sequence with several query tokens (the torch path's)."""
        return self.torch_path.prefills

    @property
    def workspace(self) -> GatherWorkspace:
        return self.torch_path.workspace

    @property
    def has_slots(self) -> bool:
        return self.slot_mapping is not None

    def attention_batch(
        self, num_kv_heads: int, group_size: int, head_dim: int
    ) -> validation.AttentionBatch:
        """The ``validation.AttentionBatch`` of this step for a cache of the given heads."""
        return validation.AttentionBatch(
            query_starts=self.query_starts,
            query_lens=self.query_lens,
            context_lens=self.context_lens,
            block_size=self.block_size,
            num_kv_heads=num_kv_heads,
            group_size=group_size,
            head_dim=head_dim,
        )


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _decode_groups(
    decodes: list[int],
    checked: validation.CheckedLengths,
    block_size: int,
    group_tokens: int,
    device: torch.device,
) -> list[DecodeGroup]:
    """Decodes sorted by context length (longest first), cut greedily into bounded groups.

    Every tensor is computed once for all decodes; a group is a slice of them.
    """
    if not decodes:
        return []
    lens = checked.context_lens.tolist()
    order = sorted(decodes, key=lambda seq: -lens[seq])
    bounds: list[tuple[int, int, int]] = []  # (first, stop, width) into `order`
    for position, seq in enumerate(order):
        blocks = -(-lens[seq] // block_size)
        if bounds:
            first, _, width = bounds[-1]
            padding = (width - blocks) * block_size
            fits = (position - first + 1) * width * block_size <= group_tokens
            if fits and padding <= max(MIN_PADDING_TOKENS, width * block_size // 4):
                bounds[-1] = (first, position + 1, width)
                continue
        bounds.append((position, position + 1, blocks))
    index = torch.tensor(order, dtype=torch.int64)
    max_width = bounds[0][2]
    ctx = checked.context_lens[index]
    ids = checked.block_tables[index, :max_width]
    unused = torch.arange(max_width).unsqueeze(0) * block_size >= ctx.unsqueeze(1)
    ids = ids.masked_fill(unused, int(ids[0, 0])).to(device)  # a valid id; its keys are masked
    beyond = torch.arange(max_width * block_size).unsqueeze(0) >= ctx.unsqueeze(1)
    bias = torch.zeros(beyond.shape, dtype=torch.float32).masked_fill_(beyond, float("-inf"))
    bias, ctx = bias.to(device), ctx.to(device)
    all_rows = checked.cu_query_lens[index]
    rows_list = all_rows.tolist()
    all_rows = all_rows.to(device)
    groups = []
    for first, stop, width in bounds:
        count, keys = stop - first, width * block_size
        rows = rows_list[first:stop]
        consecutive = rows == list(range(rows[0], rows[0] + count))
        needs_mask = min(lens[seq] for seq in order[first:stop]) < keys
        groups.append(
            DecodeGroup(
                rows=all_rows[first:stop],
                row_range=(rows[0], rows[0] + count) if consecutive else None,
                block_ids=ids[first:stop, :width].reshape(-1),
                width=width,
                context_lens=ctx[first:stop].view(count, 1, 1, 1),
                key_bias=bias[first:stop, :keys].view(count, 1, 1, keys) if needs_mask else None,
            )
        )
    return groups


def prepare_attention(
    cu_query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    num_blocks: int,
    block_size: int,
    slot_mapping: torch.Tensor | None = None,
    device: torch.device | str | None = None,
    decode_group_tokens: int = DECODE_GROUP_TOKENS,
) -> PreparedAttention:
    """Validate one step's metadata once; raises ValueError naming the first problem.

    ``num_blocks`` / ``block_size`` are the cache's (every layer's cache must match them).
    ``slot_mapping`` (optional) enables ``write_kv(..., metadata=...)``. ``device`` is where the
    caches live (default: ``block_tables``' device); CPU work is precomputed only for the CPU.
    """
    num_blocks = _positive_int("num_blocks", num_blocks)
    block_size = _positive_int("block_size", block_size)
    group_tokens = _positive_int("decode_group_tokens", decode_group_tokens)
    if not isinstance(block_tables, torch.Tensor):
        raise ValueError(f"block_tables must be a torch.Tensor, got {type(block_tables).__name__}")
    target = block_tables.device if device is None else torch.device(device)
    num_tokens = 0
    if isinstance(cu_query_lens, torch.Tensor) and cu_query_lens.dim() == 1:
        num_tokens = int(cu_query_lens[-1]) if cu_query_lens.numel() else 0
    checked = validation.check_attention_metadata(
        cu_query_lens,
        context_lens,
        block_tables,
        num_tokens=num_tokens,
        num_blocks=num_blocks,
        block_size=block_size,
        device=target,
    )
    all_slots = write_rows = write_slots = None
    if slot_mapping is not None:
        slots = validation.check_slot_mapping(
            slot_mapping, num_tokens, num_blocks * block_size, target
        )
        all_slots = slots.to(target)
        keep = slots >= 0
        if not bool(keep.all()):
            write_rows = torch.nonzero(keep).view(-1).to(target)
            slots = slots[keep]
        write_slots = slots.to(target)
    q_lens, ctx = checked.query_lens.tolist(), checked.context_lens.tolist()
    starts = checked.cu_query_lens[:-1].tolist()
    decode_rows = query_rows = None
    on_cpu = target.type == "cpu"
    if on_cpu:
        decodes = [seq for seq, q_len in enumerate(q_lens) if q_len == 1]
        if decodes:
            decode_rows = DecodeRows.of(
                decodes, checked.cu_query_lens, checked.context_lens, checked.block_tables
            )
        queried = [seq for seq, q_len in enumerate(q_lens) if q_len > 0]
        if queried:
            query_rows = DecodeRows.of_queries(
                queried, checked.cu_query_lens, checked.context_lens, checked.block_tables
            )
    return PreparedAttention(
        num_tokens=num_tokens,
        num_blocks=num_blocks,
        block_size=block_size,
        device=target,
        query_starts=tuple(starts),
        query_lens=tuple(q_lens),
        context_lens=tuple(ctx),
        block_tables=block_tables,
        slot_mapping=all_slots,
        write_rows=write_rows,
        write_slots=write_slots,
        decode_rows=decode_rows,
        query_rows=query_rows,
        checked=checked if on_cpu else None,
        decode_group_tokens=group_tokens,
    )


def check_prepared(
    metadata: PreparedAttention, num_tokens: int, k_cache: torch.Tensor, *, writes: bool = False
) -> None:
    """Per-layer facts of a prepared call: same token count, cache geometry and device."""
    if not isinstance(metadata, PreparedAttention):
        raise ValueError(
            "metadata must come from pagedserve_kernels.prepare_attention, "
            f"got {type(metadata).__name__}"
        )
    if num_tokens != metadata.num_tokens:
        raise ValueError(f"{num_tokens} tokens but the metadata was prepared for "
                         f"{metadata.num_tokens}")  # fmt: skip
    if tuple(k_cache.shape[:2]) != (metadata.num_blocks, metadata.block_size):
        raise ValueError(
            f"cache has {k_cache.shape[0]} blocks of {k_cache.shape[1]} but the metadata was "
            f"prepared for {metadata.num_blocks} blocks of {metadata.block_size}"
        )
    if k_cache.device != metadata.device:
        raise ValueError(f"cache on {k_cache.device} but the metadata was prepared for "
                         f"{metadata.device}")  # fmt: skip
    if writes and not metadata.has_slots:
        raise ValueError("write_kv needs metadata prepared with a slot_mapping")
