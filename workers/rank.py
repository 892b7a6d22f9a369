"""One tensor-parallel rank: a model shard, a KV pool shard, a CPU swap tier, one step per call.

Lifecycle (driven by `WorkerGroup`, identical whether the rank is a Ray actor or in-process):
`init_distributed` (TP > 1 only) -> `load` -> `measure_device_blocks` -> `allocate` (with the
count all ranks agreed on) -> `execute` per step -> `shutdown`. Every rank validates the plan the
same way before any collective, so a bad plan fails on all ranks instead of hanging one.
"""

from __future__ import annotations

import datetime
import hashlib
import pathlib
import socket
import time

import torch
import torch.distributed as dist

from kv_layouts import KVPool, layout_named
from pagedserve_kernels import allocate_kv_pool, copy_blocks, swap_blocks
from workers import block_io
from workers.batch import SequenceRegistry, pack_batch
from workers.config import WorkerConfig
from workers.kv_memory import KVShape, cpu_device_blocks, cpu_swap_blocks, cuda_device_blocks
from workers.loader import ModelDescription, load_model_shard
from workers.lora import AdapterSummary, LoRAStep, RankLoRA
from workers.model import AttentionMetadata, CausalLM
from workers.parallel import TensorParallel, head_layout
from workers.plan import BlockPair, PlanRejected, StepOutput, StepPlan
from workers.sampling import check_settings, prompt_logprobs, sample_rows

PROFILE_TOKENS = 2048
"""Tokens in the CUDA profiling forward pass (a large prefill chunk)."""


def free_tcp_address() -> tuple[str, int]:
    """This host's address and a free TCP port (for rank 0's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    try:
        host = socket.gethostbyname(socket.gethostname())
    except OSError:
        host = "127.0.0.1"
    return host, port


def _pairs_tensor(pairs: list[BlockPair]) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)


class WorkerRank:
    """Rank `rank` of `world_size`; `device` is "cuda" or "cpu"."""

    def __init__(
        self,
        config: WorkerConfig,
        description: ModelDescription,
        cache_root: str,
        rank: int,
        world_size: int,
        device: str,
        max_model_len: int,
    ) -> None:
        self.config = config
        self.description = description
        self.cache_root = cache_root
        self.tp = TensorParallel(rank, world_size, config.enable_expert_parallel)
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        self.max_model_len = max_model_len
        threads = config.cpu_threads() if self.device.type == "cpu" else None
        if threads is not None and threads != torch.get_num_threads():
            # set here, in the process that runs the forward pass (the replica for the local
            # backend, each rank's actor for Ray): Ray's OMP_NUM_THREADS=num_cpus is not a choice
            torch.set_num_threads(threads)
        layout = head_layout(description.spec, self.tp)
        self.kv_groups = config.kv_group_layout(description.spec.layer_sliding_windows)
        """Which pool row and block table each layer uses (`workers.kv_groups`)."""
        self.kv_shape = KVShape(
            self.kv_groups.slots,
            config.block_size,
            layout.num_kv,
            description.spec.head_dim,
            config.kv_storage_dtype(self.device),
        )
        self.registry = SequenceRegistry()
        self.model: CausalLM | None = None
        self.device_pool: torch.Tensor | None = None
        self.cpu_pool: torch.Tensor | None = None
        self.kv_pool: KVPool = layout_named(config.kv_layout).build_pool(
            config, self.kv_shape, max_model_len
        )
        """How `config.kv_layout` allocates the device pool and what a release gives back."""
        self.cpu_checksums: dict[int, bytes] = {}
        """`verify_swaps`: digest of each CPU block's bytes as its last copy left them."""
        self.lora: RankLoRA | None = None
        """Adapters and device slots (`max_loras > 0`), made with the model in `load`."""

    def node_id(self) -> str:
        """The Ray node this rank runs on (as a Ray actor)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def rendezvous_address(self) -> tuple[str, int]:
        return free_tcp_address()

    def init_distributed(self, host: str, port: int) -> None:
        """Join the TP group: NCCL on CUDA, gloo on CPU."""
        if self.tp.world_size == 1:
            return
        dist.init_process_group(
            backend="nccl" if self.device.type == "cuda" else "gloo",
            init_method=f"tcp://{host}:{port}",
            rank=self.tp.rank,
            world_size=self.tp.world_size,
            timeout=datetime.timedelta(minutes=5),
        )

    def load(self) -> None:
        self.model = load_model_shard(
            self.description,
            self.tp,
            self.config.torch_dtype,
            self.device,
            pathlib.Path(self.cache_root),
            self.config.quantized_decode,
            self.config.quantized_activations,
        )
        self.model.kv_groups = self.kv_groups
        if self.config.max_loras > 0:
            self.lora = RankLoRA(
                self.description.spec,
                self.tp,
                self.config.max_loras,
                self.config.max_lora_rank,
                self.config.torch_dtype,
                self.device,
            )

    def add_lora(self, path: str) -> AdapterSummary:
        """Reads the PEFT adapter at `path` into this rank's CPU memory (its slice). Raises
        ValueError naming the problem (LoRA off, or an adapter that cannot be served)."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled on the workers (max_loras is 0)")
        return self.lora.add_adapter(path)

    def measure_device_blocks(self) -> int:
        """Blocks this rank can hold (after a profiling forward pass on CUDA)."""
        if self.device.type == "cpu":
            return cpu_device_blocks(self.config, self.kv_shape)
        self._profile_forward()
        return cuda_device_blocks(self.config, self.kv_shape, self.device)

    def _profile_forward(self) -> None:
        tokens = min(PROFILE_TOKENS, self.max_model_len)
        blocks = -(-tokens // self.config.block_size)
        pool = self._allocate(blocks, self.device)
        metadata = AttentionMetadata(
            positions=torch.arange(tokens, device=self.device),
            slot_mapping=torch.arange(tokens, device=self.device),
            cu_query_lens=torch.tensor([0, tokens], dtype=torch.int32, device=self.device),
            context_lens=torch.tensor([tokens], dtype=torch.int32, device=self.device),
            block_tables=torch.arange(blocks, dtype=torch.int32, device=self.device)[None, :],
            logits_indices=torch.tensor([tokens - 1], device=self.device),
        )
        assert self.model is not None
        torch.cuda.reset_peak_memory_stats(self.device)
        hidden = self.model(
            torch.zeros(tokens, dtype=torch.int64, device=self.device), metadata, pool
        )
        self.model.logits(hidden[metadata.logits_indices])
        torch.cuda.synchronize(self.device)
        del pool, hidden
        torch.cuda.empty_cache()

    def _allocate(self, blocks: int, device: torch.device, pin: bool = False) -> torch.Tensor:
        return allocate_kv_pool(
            num_layers=self.kv_shape.num_layers,
            num_blocks=blocks,
            block_size=self.kv_shape.block_size,
            num_kv_heads=self.kv_shape.num_kv_heads,
            head_dim=self.kv_shape.head_dim,
            dtype=self.kv_shape.dtype,
            device=device,
            pin_memory=pin,
        )

    def cpu_blocks(self) -> int:
        return cpu_swap_blocks(self.config, self.kv_shape)

    def allocate(self, num_device_blocks: int, num_cpu_blocks: int) -> None:
        """Allocate the device pool (as `kv_pool` lays it out: under the `virtual` layout a
        virtual reservation whose physical budget of `num_device_blocks` the engine's manager
        enforces) and, when `num_cpu_blocks > 0`, the CPU swap pool."""
        self.device_pool = self.kv_pool.allocate(num_device_blocks, self.device, self._allocate)
        if num_cpu_blocks > 0:
            pin = self.device.type == "cuda"
            self.cpu_pool = self._allocate(num_cpu_blocks, torch.device("cpu"), pin)

    def resident_bytes(self) -> int | None:
        """Bytes of the device pool physically backed, when its layout can measure them."""
        return self.kv_pool.resident_bytes()

    def _check_ids(self, plan: StepPlan) -> None:
        """Sampling settings valid, token ids inside the vocabulary and block ids inside the
        pools (checked before anything is written)."""
        vocab = self.description.spec.vocab_size
        for work in plan.sequences:
            if work.sampling is not None:
                try:
                    check_settings(work.sampling)
                except ValueError as error:
                    raise PlanRejected(
                        f"step {plan.step_id}: sequence {work.seq_id}: {error}", (work.seq_id,)
                    ) from None
            if any(not 0 <= token < vocab for token in work.token_ids):
                raise PlanRejected(
                    f"step {plan.step_id}: sequence {work.seq_id} has a token id outside "
                    f"[0, {vocab})",
                    (work.seq_id,),
                )
        assert self.device_pool is not None
        device_blocks = self.device_pool.shape[2]
        cpu_blocks = 0 if self.cpu_pool is None else self.cpu_pool.shape[2]
        for work in plan.sequences:
            if any(not 0 <= block < device_blocks for block in work.table_blocks):
                raise PlanRejected(
                    f"step {plan.step_id}: sequence {work.seq_id} has a block id outside "
                    f"[0, {device_blocks})",
                    (work.seq_id,),
                )
        checks = [
            ("demote", plan.demote, device_blocks, cpu_blocks),
            ("swap_out", plan.swap_out, device_blocks, cpu_blocks),
            ("swap_in", plan.swap_in, cpu_blocks, device_blocks),
            ("promote", plan.promote, cpu_blocks, device_blocks),
            ("copy_pairs", plan.copy_pairs, device_blocks, device_blocks),
        ]
        for name, pairs, source_limit, target_limit in checks:
            for source, target in pairs:
                if not (0 <= source < source_limit and 0 <= target < target_limit):
                    raise ValueError(
                        f"step {plan.step_id}: {name} pair ({source}, {target}) is out of range "
                        f"(source pool {source_limit} blocks, target pool {target_limit})"
                    )

    def _apply_lora(self, plan: StepPlan) -> None:
        uses_lora = any(work.lora_slot != -1 for work in plan.sequences)
        if self.lora is None:
            if uses_lora or plan.lora_loads:
                raise ValueError(f"step {plan.step_id}: LoRA slots used but LoRA is not enabled")
            return
        self.lora.check(plan)
        self.lora.apply(plan)

    def _cpu_digest(self, block: int) -> bytes:
        assert self.cpu_pool is not None
        data = self.cpu_pool[:, :, block].contiguous().view(torch.uint8).numpy()
        return hashlib.blake2b(data.tobytes(), digest_size=16).digest()

    def _swap(self, plan: StepPlan) -> list[BlockPair]:
        """Demotions, swap-outs, swap-ins with promotions, copies, in that order (one batched
        copy each). Returns the (cpu, device) pairs whose CPU bytes failed their checksum."""
        assert self.device_pool is not None
        outward = plan.demote + plan.swap_out
        inward = plan.swap_in + plan.promote
        if (outward or inward) and self.cpu_pool is None:
            raise ValueError(f"step {plan.step_id}: swaps requested but the CPU tier has 0 blocks")
        verify = self.config.verify_swaps
        corrupt: list[BlockPair] = []
        if outward:
            assert self.cpu_pool is not None
            swap_blocks(self.device_pool, self.cpu_pool, _pairs_tensor(outward))
            for _, cpu_block in outward:
                if verify:
                    self.cpu_checksums[cpu_block] = self._cpu_digest(cpu_block)
                else:
                    self.cpu_checksums.pop(cpu_block, None)
        if inward:
            assert self.cpu_pool is not None
            if verify:
                for cpu_block, device_block in inward:
                    expected = self.cpu_checksums.get(cpu_block)
                    if expected is not None and expected != self._cpu_digest(cpu_block):
                        corrupt.append((cpu_block, device_block))
            swap_blocks(self.cpu_pool, self.device_pool, _pairs_tensor(inward))
        if plan.copy_pairs:
            copy_blocks(self.device_pool, _pairs_tensor(plan.copy_pairs).to(self.device))
        return corrupt

    def read_blocks(self, sources: list[tuple[str, int]]) -> block_io.BlockShard:
        """This rank's bytes of the (tier, block) `sources`, with their checksums (a peer
        replica pulls them; the engine pins the blocks until this returned)."""
        assert self.device_pool is not None, "rank not allocated"
        return block_io.read_from_tiers(
            self.device_pool, self.cpu_pool, sources, self.cpu_checksums
        )

    def write_blocks(self, blocks: list[int], shard: block_io.BlockShard) -> int:
        """Writes the verified leading rows of a peer's `shard` into device `blocks` (held by
        the engine for this); returns how many rows passed their checksum and were written."""
        assert self.device_pool is not None, "rank not allocated"
        return block_io.write_blocks(self.device_pool, blocks, shard)

    def execute(self, plan: StepPlan) -> StepOutput | None:
        """Swaps, copies, forward, and (rank 0) sampling. Ranks other than 0 return None.

        `forward_seconds` is the wall time of the whole step on rank 0 (the caller subtracts
        it from the round trip to get the call overhead).
        """
        output, _ = self.execute_with_logits(plan, keep_logits=False)
        return output

    def execute_with_logits(
        self, plan: StepPlan, keep_logits: bool = True
    ) -> tuple[StepOutput | None, torch.Tensor | None]:
        """`execute`, plus (rank 0, when asked) the float32 CPU logits of the sampled rows."""
        began = time.perf_counter()
        assert self.model is not None and self.device_pool is not None, "rank not allocated"
        for work in plan.sequences:
            if work.start_pos + len(work.token_ids) > self.max_model_len:
                raise PlanRejected(
                    f"step {plan.step_id}: sequence {work.seq_id} would reach "
                    f"{work.start_pos + len(work.token_ids)} tokens > max_model_len "
                    f"{self.max_model_len}",
                    (work.seq_id,),
                )
        snapshot = self.registry.apply(plan)
        try:
            batch = pack_batch(
                plan,
                self.registry,
                self.config.block_size,
                self.device,
                kv_groups=self.kv_groups,
            )
            self._check_ids(plan)
            self._apply_lora(plan)
            released = (snapshot.get(seq_id) for seq_id in plan.released)
            self.kv_pool.released([state.block_table for state in released if state is not None])
        except ValueError:
            self.registry.restore(snapshot)
            raise
        corrupt = self._swap(plan)
        output = StepOutput(step_id=plan.step_id, corrupt_swap_ins=corrupt)
        logits = None
        if plan.sequences:
            lora = None
            if self.lora is not None and batch.lora_slots is not None:
                lora = LoRAStep.prepare(self.lora.slots, batch.lora_slots)
            hidden = self.model(batch.token_ids, batch.metadata, self.device_pool, lora)
            if batch.sample_requests:
                logits = self.model.logits(hidden[batch.metadata.logits_indices])
                if self.tp.rank == 0:
                    drawn = sample_rows(logits, batch.sample_requests, self.config.seed)
                    for seq_id, tokens in zip(batch.sample_seq_ids, drawn, strict=True):
                        output.samples.setdefault(seq_id, []).extend(tokens)
            if batch.prompt_rows is not None:  # every rank: the LM head may be a collective
                rows = torch.tensor(batch.prompt_rows.rows, device=hidden.device)
                prompt_logits = self.model.logits(hidden[rows])
                if self.tp.rank == 0:
                    output.prompt_logprobs = prompt_logprobs(prompt_logits, batch.prompt_rows)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        output.forward_seconds = time.perf_counter() - began
        if self.tp.rank != 0:
            return None, None
        kept = logits.cpu() if keep_logits and logits is not None else None
        return output, kept

    def shutdown(self) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        self.model = None
        self.lora = None
        self.device_pool = None
        self.cpu_pool = None
        self.kv_pool.release()
