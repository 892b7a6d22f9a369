"""The KV directory at scale, synthetic: `python -m benchmarks.kv_directory --json`.

Fills a `DirectoryIndex` with `--blocks` block hashes (default one million) spread over
`--replicas` replicas, in event batches of `--batch` as engines send them, and reports:
- `events_per_s`: block events applied per second (one core, the directory's own loop);
- `memory_mb_per_million_blocks`: the index's Python heap per million indexed blocks
  (tracemalloc, so the interpreter itself is not counted);
- `query_us_p50` / `query_us_p99`: a 64-block chain query inside the directory, hits and misses
  mixed as routing sees them;
- with `--actor`, `actor_round_trip_us_p50`: the same query through a local Ray actor, which is
  what an ingress pays per request.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import tracemalloc
from typing import Any

from block_manager import BlockEvent
from cluster.serving.directory_index import DirectoryIndex, PoolView

CHAIN_BLOCKS = 64


def fill(index: DirectoryIndex, rng: random.Random, blocks: int, replicas: int, batch: int):
    """Stores `blocks` random hashes as `replicas` replicas' event batches; returns the
    chains written (each 64 consecutive hashes of one replica) and the seconds spent applying."""
    names = [f"replica-{r}" for r in range(replicas)]
    for name in names:
        index.snapshot(name, 1, {"device": [], "cpu": []}, PoolView())
    seqs = dict.fromkeys(names, 1)
    chains: list[list[bytes]] = []
    applying = 0.0
    written = 0
    while written < blocks:
        name = names[(written // batch) % replicas]
        hashes = [rng.randbytes(32) for _ in range(min(batch, blocks - written))]
        events = [BlockEvent(True, h, "device") for h in hashes]
        seqs[name] += 1
        start = time.perf_counter()
        index.apply(name, seqs[name], events, PoolView())
        applying += time.perf_counter() - start
        chains.extend(
            hashes[i : i + CHAIN_BLOCKS] for i in range(0, len(hashes) - CHAIN_BLOCKS + 1, 512)
        )
        written += len(hashes)
    return chains, applying


def query_latencies(index: DirectoryIndex, chains: list[list[bytes]], rng: random.Random):
    latencies = []
    for _ in range(5000):
        chain = rng.choice(chains)
        if rng.random() < 0.3:  # a miss after a shared beginning
            chain = chain[:16] + [rng.randbytes(32) for _ in range(CHAIN_BLOCKS - 16)]
        start = time.perf_counter()
        index.query(chain)
        latencies.append((time.perf_counter() - start) * 1e6)
    return sorted(latencies)


def actor_round_trip(chains: list[list[bytes]], rng: random.Random) -> float:
    """p50 microseconds of a 64-block query through a local Ray actor holding a small index."""
    import ray

    from cluster.serving.kv_directory import KVDirectory

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        directory = ray.remote(KVDirectory).options(num_cpus=0).remote(100_000, 60.0)
        sample = chains[:200]
        events = [BlockEvent(True, h, "device") for chain in sample for h in chain]
        ray.get(directory.snapshot.remote("replica-0", 1, {"device": [], "cpu": []}, PoolView()))
        ray.get(directory.apply.remote("replica-0", 2, events, PoolView()))
        for chain in sample[:20]:  # warm up
            ray.get(directory.query.remote(chain))
        trips = []
        for _ in range(500):
            chain = rng.choice(sample)
            start = time.perf_counter()
            ray.get(directory.query.remote(chain))
            trips.append((time.perf_counter() - start) * 1e6)
        return statistics.median(trips)
    finally:
        ray.shutdown()


def run(blocks: int, replicas: int, batch: int, actor: bool, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    tracemalloc.start()
    before, _ = tracemalloc.get_traced_memory()
    index = DirectoryIndex(max_entries=blocks)
    chains, applying = fill(index, rng, blocks, replicas, batch)
    after, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # the chains list is the benchmark's own: subtract its share (list of lists of refs)
    chain_bytes = sum(sys.getsizeof(c) for c in chains) + sys.getsizeof(chains)
    index_bytes = after - before - chain_bytes
    latencies = query_latencies(index, chains, rng)
    report: dict[str, Any] = {
        "config": {"blocks": blocks, "replicas": replicas, "batch": batch, "seed": seed},
        "entries": index.stats().entries,
        "events_per_s": round(blocks / applying),
        "memory_mb_per_million_blocks": round(index_bytes / blocks * 1e6 / 2**20, 1),
        "query_chain_blocks": CHAIN_BLOCKS,
        "query_us_p50": round(latencies[len(latencies) // 2], 2),
        "query_us_p99": round(latencies[int(len(latencies) * 0.99)], 2),
    }
    if actor:
        report["actor_round_trip_us_p50"] = round(actor_round_trip(chains, rng), 1)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1024, help="events per batch")
    parser.add_argument("--actor", action="store_true", help="also time a query via Ray")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    report = run(args.blocks, args.replicas, args.batch, args.actor, args.seed)
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    sys.exit(main())
