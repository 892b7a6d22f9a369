"""Block manager benchmark: seeded synthetic serving traces driven through `KVCacheManager`.

``python -m benchmarks.block_manager --json`` prints one JSON object:

- trace "prefix": 256 requests, each a 512-token shared system prompt plus 100-400 unique tokens,
  128 output tokens, at most 64 running, block size 16, 4096 device blocks. The scheduler admits one
  waiting request per step (its whole prompt is prefilled in that step, which samples its first
  token) and decodes every running request each step. A request admitted after the first one's
  prefill finds the 32 sealed system-prompt blocks: 255 x 512 = 130,560 prefix-hit tokens.
  Timed: every block-manager call the engine makes (allocate, slot_mapping, block_table,
  mark_computed with its hashing, append_token, free), divided by the 32,768 generated tokens;
  ``us_per_generated_token_without_reads`` leaves out the two per-step reads.
  The same trace runs with prefix caching off, side by side.
- ``decode_step_us_p50``: one decode step's block operations for 256 running sequences.
- trace "mixed": long-tailed prompt and output lengths, 40% of prompts behind one of three shared
  system prompts, a quarter of the requests with n=4 parallel sampling (fork + copy-on-write),
  preemption by swap (groups) or recompute when the pool is full. ``kv_utilization`` = tokens
  held / token slots allocated, averaged over the steps at saturation (>= 95% of device blocks in
  use), beside a contiguous max-length reservation baseline
  computed on the same steps.

Times are CPU time of this single-threaded process (``time.process_time``), the best of
``--repeats`` runs, because the machine may be shared; wall-clock figures are printed beside them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from block_manager import CacheIdentity, CacheKey, KVCacheManager, NoFreeBlocks

VOCAB = 32_000
BLOCK_SIZE = 16
SEED = CacheIdentity(model_weights_digest="bench-weights", tokenizer_digest="bench-tok").digest()


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(count)]


# --------------------------------------------------------------------------- trace "prefix"
def run_prefix_trace(
    *, enable_prefix_caching: bool = True, include_reads: bool = True, seed: int = 0
) -> dict[str, float]:
    """Drive the "prefix" trace; returns timing and counters.

    The whole replay is timed: the manager calls plus the driver's own bookkeeping (a list
    filter when requests finish, a counter read per step). With ``include_reads=False`` the
    per-step reads (`slot_mapping`, `block_table`) are skipped, leaving the block operations
    proper: allocate, mark_computed (hashing), append_token and free.
    """
    rng = random.Random(seed)
    system = _tokens(rng, 512)
    prompts = [system + _tokens(rng, rng.randint(100, 400)) for _ in range(256)]
    outputs = [_tokens(rng, 128) for _ in range(256)]
    manager = KVCacheManager(
        num_device_blocks=4096,
        num_cpu_blocks=256,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=enable_prefix_caching,
    )
    cpu_clock, wall_clock = time.process_time, time.perf_counter
    waiting = deque(range(256))
    running: list[int] = []
    generated = [0] * 256
    peak_used = 0
    allocate, slot_mapping, block_table = (
        manager.allocate,
        manager.slot_mapping,
        manager.block_table,
    )
    mark_computed, append_token, free = manager.mark_computed, manager.append_token, manager.free
    lengths = [0] * 256  # tokens per sequence, as the engine tracks them itself
    # One clock pair around the whole replay: reading the CPU clock is a system call that costs
    # about as much as a decode step's block operations for one sequence.
    cpu_start, wall_start = cpu_clock(), wall_clock()
    while waiting or running:
        # Decode: each running request computes its last sampled token and samples the next one.
        finished = []
        for seq in running:
            n = lengths[seq]
            if include_reads:
                slot_mapping(seq, n - 1, n)
                block_table(seq)
            mark_computed(seq, n)
            count = generated[seq]
            append_token(seq, outputs[seq][count])
            generated[seq] = count + 1
            lengths[seq] = n + 1
            if count + 1 == 128:
                finished.append(seq)
        # Admission: one prefill per step while fewer than 64 run.
        if waiting and len(running) < 64:
            seq = waiting.popleft()
            prompt = prompts[seq]
            cached = allocate(seq, prompt, CacheKey(SEED))
            if include_reads:
                slot_mapping(seq, cached, len(prompt))
                block_table(seq)
            mark_computed(seq, len(prompt))
            append_token(seq, outputs[seq][0])
            generated[seq] = 1
            lengths[seq] = len(prompt) + 1
            running.append(seq)
        for seq in finished:
            free(seq)
        if finished:
            done = set(finished)
            running = [seq for seq in running if seq not in done]
        peak_used = max(peak_used, 4096 - manager.num_free_device_blocks())
    cpu_elapsed, wall_elapsed = cpu_clock() - cpu_start, wall_clock() - wall_start
    snapshot = manager.pressure()
    manager.check_integrity()
    total_generated = sum(generated)
    return {
        "us_per_generated_token": cpu_elapsed / total_generated * 1e6,
        "us_per_generated_token_wall": wall_elapsed / total_generated * 1e6,
        "generated_tokens": total_generated,
        "prefix_hit_tokens": snapshot.prefix_hit_tokens,
        "prefix_query_tokens": snapshot.prefix_query_tokens,
        "peak_used_blocks": peak_used,
    }


def measure_decode_step(
    *, num_seqs: int = 256, steps: int = 64, seed: int = 1
) -> tuple[list[float], list[float]]:
    """Per-step CPU and wall time (us) of one decode step's block operations for `num_seqs`."""
    rng = random.Random(seed)
    system = _tokens(rng, 512)
    manager = KVCacheManager(num_device_blocks=16_384, num_cpu_blocks=0, block_size=BLOCK_SIZE)
    for seq in range(num_seqs):
        prompt = system + _tokens(rng, rng.randint(100, 400))
        manager.allocate(seq, prompt, CacheKey(SEED))
        manager.mark_computed(seq, len(prompt))
        manager.append_token(seq, rng.randrange(VOCAB))
    tokens = [_tokens(rng, num_seqs) for _ in range(steps)]
    seqs = list(range(num_seqs))
    cpu_clock, wall_clock = time.process_time, time.perf_counter
    cpu_us, wall_us = [], []
    for step in range(steps):
        sampled = tokens[step]
        cpu_start, wall_start = cpu_clock(), wall_clock()
        for seq in seqs:
            n = manager.num_tokens(seq)
            manager.slot_mapping(seq, n - 1, n)
            manager.block_table(seq)
            manager.mark_computed(seq, n)
            manager.append_token(seq, sampled[seq])
        cpu_us.append((cpu_clock() - cpu_start) * 1e6)
        wall_us.append((wall_clock() - wall_start) * 1e6)
    manager.check_integrity()
    return cpu_us, wall_us


# --------------------------------------------------------------------------- trace "mixed"
@dataclass
class _Branch:
    seq_id: int
    prompt: list[int]
    max_out: int
    out: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # what to sample, pre-drawn


@dataclass
class _Group:
    branches: list[_Branch]
    n: int
    forked: bool = False


def _live_ids(manager: KVCacheManager, group: _Group) -> list[int]:
    """The group's branches that hold a table (finished ones are not re-prefilled)."""
    return [b.seq_id for b in group.branches if manager.has_sequence(b.seq_id)]


def _lognormal_int(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, round(rng.lognormvariate(0.0, sigma) * median)))


def run_mixed_trace(*, num_requests: int = 384, seed: int = 2) -> dict[str, float]:
    """Saturate a 4096-block pool with long-tailed requests, n=4 groups, swaps and recomputes."""
    rng = random.Random(seed)
    manager = KVCacheManager(
        num_device_blocks=4096, num_cpu_blocks=256, block_size=BLOCK_SIZE, watermark_blocks=40
    )
    systems = [_tokens(rng, length) for length in (256, 512, 1024)]
    next_id = 0
    waiting: deque[_Group] = deque()
    for _ in range(num_requests):
        n = 4 if rng.random() < 0.25 else 1
        prompt = _tokens(rng, _lognormal_int(rng, 400, 0.9, 16, 6000))
        if rng.random() < 0.4:
            prompt = rng.choice(systems) + prompt
        branches = []
        for _ in range(n):
            max_out = _lognormal_int(rng, 250, 0.9, 1, 3000)
            branches.append(_Branch(next_id, prompt, max_out, tokens=_tokens(rng, max_out)))
            next_id += 1
        waiting.append(_Group(branches, n))
    swapped: deque[_Group] = deque()
    running: list[_Group] = []
    utilization: list[float] = []
    contiguous: list[float] = []
    preempt_swap = preempt_recompute = 0
    steps = 0
    while waiting or swapped or running:
        steps += 1
        # Resume swapped groups first, then admit new or recomputed ones (whole prefill).
        while swapped and manager.can_swap_in(_live_ids(manager, swapped[0])):
            group = swapped.popleft()
            manager.swap_in(_live_ids(manager, group))
            running.append(group)
        budget = 8192
        while waiting and not swapped and budget > 0 and len(running) < 256:
            group = waiting[0]
            # A fresh group prefills its prompt once and forks; a recomputed one re-prefills
            # each unfinished branch's prompt + output (prefix hits share the prompt).
            prefills = [b for b in group.branches if len(b.out) < b.max_out]
            if not group.forked:
                prefills = prefills[:1]
            if not all(manager.can_allocate(b.prompt + b.out, CacheKey(SEED)) for b in prefills):
                break
            admitted: list[int] = []
            try:
                for branch in prefills:
                    tokens = branch.prompt + branch.out
                    manager.allocate(branch.seq_id, tokens, CacheKey(SEED))
                    admitted.append(branch.seq_id)
                    manager.mark_computed(branch.seq_id, len(tokens))
                    budget -= len(tokens)
            except NoFreeBlocks:
                for seq_id in admitted:  # the branches together do not fit yet
                    manager.free(seq_id)
                break
            waiting.popleft()
            if not group.forked:
                parent = group.branches[0].seq_id
                for child in group.branches[1:]:
                    manager.fork(parent, child.seq_id)
                group.forked = True
            for branch in group.branches:
                if len(branch.out) < branch.max_out:
                    branch.out.append(branch.tokens[len(branch.out)])
                    manager.append_token(branch.seq_id, branch.out[-1])
            running.append(group)
        # Make room for one decode token per running branch, preempting the newest groups.
        while running and not manager.can_append(
            [b.seq_id for g in running for b in g.branches if len(b.out) < b.max_out]
        ):
            victim = running.pop()
            ids = _live_ids(manager, victim)
            if manager.can_swap_out(ids):
                manager.swap_out(ids)
                swapped.append(victim)
                preempt_swap += 1
            else:
                for seq_id in ids:
                    manager.free(seq_id)
                victim.forked = True  # recompute each branch as its own prompt + output
                waiting.appendleft(victim)
                preempt_recompute += 1
        snapshot = manager.pressure()
        if snapshot.device.used >= 0.95 * snapshot.device.total:
            utilization.append(snapshot.kv_utilization)
            reserved = sum(len(b.prompt) + b.max_out for g in running for b in g.branches) + sum(
                len(b.prompt) + b.max_out for g in swapped for b in g.branches
            )
            contiguous.append(snapshot.tokens_held / reserved)
        still_running = []
        for group in running:
            for branch in group.branches:
                if len(branch.out) >= branch.max_out:
                    continue
                seq_id = branch.seq_id
                n = manager.num_tokens(seq_id)
                manager.slot_mapping(seq_id, n - 1, n)
                manager.mark_computed(seq_id, n)
                branch.out.append(branch.tokens[len(branch.out)])
                manager.append_token(seq_id, branch.out[-1])
            if all(len(b.out) >= b.max_out for b in group.branches):
                for seq_id in _live_ids(manager, group):
                    manager.free(seq_id)
            else:
                still_running.append(group)
        running = still_running
        if steps % 64 == 0:
            manager.check_integrity(verify_hashes=False)
    manager.check_integrity()
    final = manager.pressure()
    return {
        "kv_utilization": statistics.fmean(utilization) if utilization else 0.0,
        "kv_utilization_min": min(utilization) if utilization else 0.0,
        "contiguous_reservation_utilization": statistics.fmean(contiguous) if contiguous else 0.0,
        "saturated_steps": len(utilization),
        "steps": steps,
        "cow_copies": final.cow_copies,
        "swap_out_blocks": final.swap_out_blocks,
        "swap_in_blocks": final.swap_in_blocks,
        "preemptions_swap": preempt_swap,
        "preemptions_recompute": preempt_recompute,
        "prefix_hit_tokens": final.prefix_hit_tokens,
    }


def _other_block_managers() -> dict[str, str]:
    """Other block managers the same trace could run through, where importable."""
    found = {}
    for module in ("vllm", "nanovllm"):
        importable = importlib.util.find_spec(module) is not None
        found[module] = "importable but not wired" if importable else "not importable"
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeats", type=int, default=5, help="best of N for the prefix trace")
    args = parser.parse_args()
    runs = [run_prefix_trace() for _ in range(args.repeats)]
    best = min(runs, key=lambda run: run["us_per_generated_token"])
    uncached = min(
        (run_prefix_trace(enable_prefix_caching=False) for _ in range(args.repeats)),
        key=lambda run: run["us_per_generated_token"],
    )
    without_reads = min(
        run_prefix_trace(include_reads=False)["us_per_generated_token"] for _ in range(args.repeats)
    )
    step_cpu, step_wall = measure_decode_step()
    mixed = run_mixed_trace()
    result = {
        "trace_prefix": best,
        "trace_prefix_no_prefix_caching": uncached,
        "us_per_generated_token": round(best["us_per_generated_token"], 3),
        "us_per_generated_token_wall": round(best["us_per_generated_token_wall"], 3),
        "us_per_generated_token_without_reads": round(without_reads, 3),
        "us_per_generated_token_median_of_runs": round(
            statistics.median(run["us_per_generated_token"] for run in runs), 3
        ),
        "timing_note": (
            "us figures are CPU time of this single-threaded process (time.process_time), best "
            "of --repeats runs; *_wall are wall-clock and include time the shared machine gave "
            "to other processes"
        ),
        "prefix_hit_tokens": best["prefix_hit_tokens"],
        "prefix_caching_block_saving_ratio": round(
            uncached["peak_used_blocks"] / best["peak_used_blocks"], 3
        ),
        "decode_step_us_p50": round(statistics.median(step_cpu), 1),
        "decode_step_us_p50_wall": round(statistics.median(step_wall), 1),
        "decode_step_sequences": 256,
        "trace_mixed": mixed,
        "kv_utilization": round(mixed["kv_utilization"], 4),
        "paged_vs_contiguous_utilization_ratio": round(
            mixed["kv_utilization"] / mixed["contiguous_reservation_utilization"], 3
        ),
        "other_block_managers": _other_block_managers(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
