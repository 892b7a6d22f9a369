"""The engine's per-step Python time with no model: schedule() + on_step_done() at N sequences.

`python -m benchmarks.engine_overhead --json [--seqs 64 256] [--stub-ms 10]` runs `EngineCore`
over a worker stand-in that answers every plan at once (no forward pass), so what is timed is the
scheduler's own work per decode step with `--seqs` sequences running: building the plan
(appends, block-table deltas, slot bookkeeping) and applying the step's output (marking KV
computed). `engine_us_per_step` adds the rest of the engine's step (detokenizing, stop checks,
outputs, metrics); `engine_cpu_us_per_step` is the engine thread's CPU time per step.

With `--stub-ms`, the stand-in's whole `execute` (filling placeholders, the forward pass, building
the sampled tokens: a worker's step) takes that long, sleeping for what its own work leaves (as a
GPU's step leaves the host free), and `step_over_stub` is the step's wall time over the stub's:
what the engine's own work adds at a GPU's step rate (1.0 = none; the goal is <= 1.05).
`stand_in_us_per_step` is the stand-in's own work inside that window (not the engine's).
`--async-scheduling on` (or `both`, each `--seqs` without then with it) sets
`scheduler.async_scheduling`: the next step is planned while the current one executes (its
decodes' tokens placeholders the stand-in fills from its previous output), so the engine's work
leaves the gap between two forward passes (`engine_cpu_us_per_step` still counts all of it;
the scheduler's share includes `schedule_ahead`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import Future
from typing import Any

from cluster.engine.config import EngineConfig
from cluster.engine.engine_core import EngineCore
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.scheduler_step import SchedulerStep
from cluster.engine.step_pipeline import StepPipeline, ThreadLauncher
from workers import ModelInfo, load_tokenizer
from workers.placeholders import PlaceholderFiller
from workers.plan import SampledToken, StepOutput, StepPlan

FIRST_TOKEN = 1000


class EchoWorkers:
    """Answers a plan instantly: each sampled token is a function of its position."""

    def __init__(
        self, *, num_device_blocks: int, block_size: int, max_model_len: int, stub_s: float = 0.0
    ) -> None:
        self.stub_s = stub_s
        self.own_seconds: list[float] = []
        self.placeholders = PlaceholderFiller()
        self.num_device_blocks = num_device_blocks
        self.num_cpu_blocks = 0
        self.model_info = ModelInfo(
            architecture="echo", num_layers=1, hidden_size=1, num_heads=1, num_kv_heads=1,
            head_dim=1, vocab_size=49152, max_model_len=max_model_len, sliding_window=None,
            bos_token_id=1, eos_token_ids=(2,), weights_digest="echo-v1", dtype="float32",
            rope="none", quantization="none", kv_bytes_per_block=block_size * 1024,
        )  # fmt: skip

    def execute(self, plan: StepPlan) -> StepOutput:
        """The plan's output, returned `stub_s` after the call began (at once without a stub):
        the stand-in's own work (placeholders, tokens) is part of the worker's step."""
        began = time.perf_counter()
        plan = self.placeholders.fill(plan)  # async scheduling's, between two forward passes
        output = StepOutput(step_id=plan.step_id)
        for work in plan.sequences:
            if work.num_samples:
                position = work.start_pos + len(work.token_ids)
                token = SampledToken(FIRST_TOKEN + (position * 7 + work.seq_id) % 20000)
                output.samples[work.seq_id] = [token] * work.num_samples
        self.placeholders.record(output)
        own = time.perf_counter() - began
        self.own_seconds.append(own)
        if self.stub_s > own:
            time.sleep(self.stub_s - own)
        return output

    def shutdown(self) -> None:
        pass


def measure(
    num_seqs: int = 64,
    prompt_len: int = 200,
    steps: int = 300,
    stub_s: float = 0.0,
    async_scheduling: bool = False,
) -> dict[str, Any]:
    """Per-step timings once all `num_seqs` sequences are decoding (prefill steps excluded),
    the steps driven by the engine's `StepPipeline` as `LLM` drives them (`ThreadLauncher`: the
    execution in a thread of its own with async scheduling, in this one without)."""
    block_size, max_model_len = 16, 2048
    config = EngineConfig().with_overrides(
        {
            "cache": {"block_size": block_size, "watermark": 0.0},
            "scheduler": {
                "max_num_seqs": num_seqs,
                "max_num_batched_tokens": 8192,
                "async_scheduling": async_scheduling,
            },
            "parallel": {"backend": "local"},
        }
    )
    workers = EchoWorkers(
        num_device_blocks=num_seqs * (prompt_len + steps + 128) // block_size + 64,
        block_size=block_size,
        max_model_len=max_model_len,
        stub_s=stub_s,
    )
    engine = EngineCore(config, workers, tokenizer=load_tokenizer("default"))  # type: ignore[arg-type]
    scheduler = engine.scheduler
    spent = {"schedule": 0.0, "schedule_ahead": 0.0, "on_step_done": 0.0}
    for name in spent:
        method = getattr(scheduler, name)

        def timed(*args: Any, _method: Any = method, _name: str = name) -> Any:
            start = time.perf_counter()
            try:
                return _method(*args)
            finally:
                spent[_name] += time.perf_counter() - start

        setattr(scheduler, name, timed)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True)
    for index in range(num_seqs):
        prompt = [FIRST_TOKEN + (index * 31 + t) % 20000 for t in range(prompt_len)]
        engine.add_request(engine.request_builder.build({"prompt_token_ids": prompt}, params))
    launcher = ThreadLauncher(engine, overlap=async_scheduling)
    pipeline: StepPipeline[Future[StepOutput | Exception | None]] = StepPipeline(
        engine, launcher, overlap=async_scheduling
    )

    def one_step() -> SchedulerStep:
        in_flight = pipeline.start()
        assert in_flight is not None
        step = pipeline.advance(in_flight.result())
        pipeline.settle()
        return step

    while len(scheduler.running) < num_seqs or scheduler.waiting:
        one_step()
    for _ in range(5):  # every prompt is computed: steady decode from here
        one_step()
    workers.own_seconds.clear()
    scheduler_us: list[float] = []
    engine_us: list[float] = []
    cpu_us: list[float] = []
    for _ in range(steps):
        spent["schedule"] = spent["schedule_ahead"] = spent["on_step_done"] = 0.0
        start, cpu_start = time.perf_counter(), time.thread_time()
        step = one_step()
        engine_us.append((time.perf_counter() - start) * 1e6)
        cpu_us.append((time.thread_time() - cpu_start) * 1e6)
        scheduler_us.append(sum(spent.values()) * 1e6)
        assert len(step.plan.sequences) == num_seqs, (len(step.plan.sequences), num_seqs)
    pipeline.drain(Future.result)
    launcher.close()
    engine.shutdown()
    p50 = statistics.median(scheduler_us)
    return {
        "async_scheduling": async_scheduling,
        "running_sequences": num_seqs,
        "steps": steps,
        "scheduler_us_per_step_p50": round(p50, 1),
        "scheduler_us_per_step_mean": round(statistics.fmean(scheduler_us), 1),
        "scheduler_steps_per_s": round(1e6 / p50, 1),
        "engine_us_per_step_p50": round(statistics.median(engine_us), 1),
        "engine_steps_per_s": round(1e6 / statistics.median(engine_us), 1),
        "engine_cpu_us_per_step_p50": round(statistics.median(cpu_us), 1),
        "stub_ms": stub_s * 1e3,
        "stand_in_us_per_step_p50": round(statistics.median(workers.own_seconds) * 1e6, 1),
        "step_over_stub": (
            round(statistics.median(engine_us) / (stub_s * 1e6), 3) if stub_s else None
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--seqs", type=int, nargs="+", default=[64])
    parser.add_argument("--stub-ms", type=float, default=0.0, help="a forward pass of this long")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3, help="best p50 of this many runs")
    parser.add_argument(
        "--async-scheduling",
        choices=["off", "on", "both"],
        default="off",
        help="scheduler.async_scheduling; both: each --seqs off then on, side by side",
    )
    args = parser.parse_args()
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.async_scheduling]
    results = []
    for seqs in args.seqs:
        for overlap in modes:
            runs = [
                measure(seqs, steps=args.steps, stub_s=args.stub_ms / 1e3, async_scheduling=overlap)
                for _ in range(args.repeats)
            ]
            results.append(min(runs, key=lambda r: r["engine_us_per_step_p50"]))
    output = results[0] if len(results) == 1 else {"runs": results}
    print(json.dumps(output, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
