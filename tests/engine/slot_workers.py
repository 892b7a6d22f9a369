"""A pure-Python stand-in for the workers that makes paging mistakes visible.

`SlotWorkers` executes `StepPlan`s on a "KV cache" whose slots hold (token id, position). Each
step applies swaps and copies, writes every new token into the slot its block table names, then
reads each sequence's whole context back through its table. The next token is a hash of that
context, so a wrong table, a missed copy-on-write, a lost swap or two sequences writing one slot
change the generated tokens. `reference_tokens` computes the same tokens with no paging at all:
the oracle the engine's outputs must equal.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from workers import ModelInfo
from workers.placeholders import PlaceholderFiller
from workers.plan import SampledToken, SamplingSettings, StepOutput, StepPlan

EOS = 2
FIRST_TOKEN = 300
TOKEN_RANGE = 3000
EOS_ONE_IN = 29

Slot = tuple[int, int] | None


def next_token(
    context: Sequence[int], settings: SamplingSettings, branch_index: int, output_index: int
) -> int:
    """Greedy: a function of the context; sampled: also of (seed, branch, output index)."""
    hasher = hashlib.sha256(struct.pack(f"<{len(context)}I", *context))
    if settings.temperature > 0:
        hasher.update(struct.pack("<QII", settings.seed, branch_index, output_index))
    value = int.from_bytes(hasher.digest()[:8], "little")
    if value % EOS_ONE_IN == 0:
        return EOS
    return FIRST_TOKEN + value % TOKEN_RANGE


def reference_tokens(
    prompt: Sequence[int],
    settings: SamplingSettings,
    *,
    branch_index: int,
    max_tokens: int,
    ignore_eos: bool = False,
) -> list[int]:
    """The generated tokens of one branch, computed directly from the growing context."""
    context = list(prompt)
    out: list[int] = []
    while len(out) < max_tokens:
        token = next_token(context, settings, branch_index, len(out))
        out.append(token)
        context.append(token)
        if token == EOS and not ignore_eos:
            break
    return out


def slot_model_info(max_model_len: int, block_size: int) -> ModelInfo:
    return ModelInfo(
        architecture="slot-simulator",
        num_layers=1,
        hidden_size=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=1,
        vocab_size=49152,
        max_model_len=max_model_len,
        sliding_window=None,
        bos_token_id=1,
        eos_token_ids=(EOS,),
        weights_digest="slot-simulator-v1",
        dtype="float32",
        rope="none",
        quantization="none",
        kv_bytes_per_block=block_size * 1024,
    )


class SlotWorkers:
    """Executes plans like a worker group (same methods the engine calls)."""

    def __init__(
        self, *, num_device_blocks: int, num_cpu_blocks: int, block_size: int, max_model_len: int
    ) -> None:
        self.block_size = block_size
        self.num_device_blocks = num_device_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.model_info = slot_model_info(max_model_len, block_size)
        self.device: list[list[Slot]] = [[None] * block_size for _ in range(num_device_blocks)]
        self.cpu: list[list[Slot]] = [[None] * block_size for _ in range(num_cpu_blocks)]
        self.tables: dict[int, list[int]] = {}
        self.settings: dict[int, SamplingSettings] = {}
        self.plans: list[StepPlan] = []
        """Every plan executed, placeholders filled."""
        self.placeholders = PlaceholderFiller()

    def execute(self, plan: StepPlan) -> StepOutput:
        plan = self.placeholders.fill(plan)
        self.placeholders.record(None)  # a plan that fails leaves nothing to fill from
        self.plans.append(plan)
        scheduled = {work.seq_id for work in plan.sequences}
        assert not scheduled & set(plan.released), "a released sequence is also scheduled"
        for seq_id in plan.released:
            self.tables.pop(seq_id, None)
            self.settings.pop(seq_id, None)
        for device_block, cpu_block in plan.demote + plan.swap_out:
            self.cpu[cpu_block] = list(self.device[device_block])
        for cpu_block, device_block in plan.swap_in + plan.promote:
            self.device[device_block] = list(self.cpu[cpu_block])
        for src, dst in plan.copy_pairs:
            self.device[dst] = list(self.device[src])
        written: set[tuple[int, int]] = set()
        for work in plan.sequences:
            table = self.tables.setdefault(work.seq_id, [])
            del table[work.table_start :]
            table.extend(work.table_blocks)
            if work.sampling is not None:
                self.settings[work.seq_id] = work.sampling
            for offset, token in enumerate(work.token_ids):
                position = work.start_pos + offset
                block = table[position // self.block_size]
                slot = (block, position % self.block_size)
                assert slot not in written, f"two sequences write slot {slot} in one step"
                written.add(slot)
                self.device[block][slot[1]] = (token, position)
        output = StepOutput(step_id=plan.step_id)
        for work in plan.sequences:
            context = self._read_context(work.seq_id, work.start_pos + len(work.token_ids))
            settings = self.settings[work.seq_id]
            output.samples[work.seq_id] = [
                SampledToken(
                    next_token(context, settings, work.branch_index + i, work.output_index)
                )
                for i in range(work.num_samples)
            ]
            if work.num_samples == 0:
                del output.samples[work.seq_id]
        self.placeholders.record(output)
        return output

    async def execute_async(self, plan: StepPlan) -> StepOutput:
        return self.execute(plan)

    def shutdown(self) -> None:
        pass

    def _read_context(self, seq_id: int, length: int) -> list[int]:
        table = self.tables[seq_id]
        context = []
        for position in range(length):
            entry = self.device[table[position // self.block_size]][position % self.block_size]
            assert entry is not None and entry[1] == position, (
                f"sequence {seq_id}: slot of position {position} holds {entry}"
            )
            context.append(entry[0])
        return context
