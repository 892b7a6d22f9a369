"""One seeded workload through the engine under one KV layout: the driver behind `layouts.py`.

The workload models clients that ask for a generous `max_tokens` (the cap a contiguous server must
reserve for) and usually stop far earlier (an end-of-sequence the model chooses): each request has
a long-tailed prompt length, a long-tailed actual output length, and a cap `max_tokens` well above
it. The driver ends a request when it reaches its actual length (as an EOS would; the engine's
`abort` frees its memory at once), so every layout generates exactly the same tokens and only the
memory it reserves differs. The shared-prefix variant prepends one common system prefix.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.layout_recorder import LayoutRecorder
from cluster.engine.config import EngineConfig
from cluster.engine.engine_core import EngineCore
from cluster.engine.request import Request
from cluster.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    max_tokens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def _long_tail(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, round(rng.lognormvariate(0.0, sigma) * median)))


def make_workload(
    num_requests: int,
    seed: int,
    *,
    max_model_len: int,
    shared_prefix: int = 0,
    max_tokens_cap: int = 512,
) -> Workload:
    """Prompts of median 48 tokens and output of median 32 (lognormal tails up to ~8x), with a
    client cap of `max_tokens_cap` output tokens; `shared_prefix` common tokens in front."""
    rng = random.Random(seed)
    prefix = [rng.randrange(300, 40000) for _ in range(shared_prefix)]
    prompts, outputs, caps = [], [], []
    for _ in range(num_requests):
        prompt_len = _long_tail(rng, 48, 0.9, 4, max_model_len // 3)
        prompt = prefix + [rng.randrange(300, 40000) for _ in range(prompt_len)]
        cap = min(max_tokens_cap, max_model_len - len(prompt))
        prompts.append(prompt)
        caps.append(cap)
        outputs.append(min(cap, _long_tail(rng, 32, 1.0, 1, max_model_len)))
    name = "shared_prefix" if shared_prefix else "mixed"
    return Workload(name, prompts, outputs, caps)


@dataclass
class RunResult:
    layout: str
    block_size: int
    workload: str
    seconds: float
    output_tokens: int
    ttft: list[float]
    tpot: list[float]
    metrics: dict[str, Any] = field(default_factory=dict)
    timeline: dict[str, list[float]] = field(default_factory=dict)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def run_layout(
    base: EngineConfig,
    workload: Workload,
    layout: str,
    block_size: int,
    *,
    slo_ttft_s: float,
    slo_tpot_s: float,
) -> RunResult:
    """Runs the whole workload (all requests arrive at once) and gathers the layout's figures."""
    config = base.with_overrides({"cache": {"kv_layout": layout, "block_size": block_size}})
    engine = EngineCore(config)
    recorder = LayoutRecorder.of(engine, keep_samples=True)
    try:
        started = time.perf_counter()
        requests: list[tuple[Request, int]] = []
        for prompt, cap, wanted in zip(
            workload.prompts, workload.max_tokens, workload.output_lens, strict=True
        ):
            params = SamplingParams(temperature=0.0, max_tokens=cap, ignore_eos=True)
            request = engine.add_request(
                engine.request_builder.build({"prompt_token_ids": prompt}, params)
            )
            requests.append((request, wanted))
        pending = {request.request_id: wanted for request, wanted in requests}
        while engine.has_work():
            for output in recorder.step(engine):
                if output.error is not None:
                    raise RuntimeError(f"{layout}: {output.request_id}: {output.error}")
            for request, wanted in requests:
                if request.request_id in pending and len(request.branches[0].output_token_ids) >= (
                    wanted
                ):
                    engine.abort(request.request_id)  # the request's "EOS": it ends here
                    del pending[request.request_id]
        seconds = time.perf_counter() - started
        produced = sum(len(r.branches[0].output_token_ids) for r, _ in requests)
        if produced != workload.output_tokens:
            raise RuntimeError(
                f"{layout}: produced {produced} tokens, expected {workload.output_tokens}"
            )
        return _summarize(
            engine,
            recorder,
            workload,
            layout,
            block_size,
            requests,
            seconds,
            produced,
            slo_ttft_s,
            slo_tpot_s,
        )
    finally:
        engine.shutdown()


def _summarize(
    engine: EngineCore,
    recorder: LayoutRecorder,
    workload: Workload,
    layout: str,
    block_size: int,
    requests: list[tuple[Request, int]],
    seconds: float,
    produced: int,
    slo_ttft_s: float,
    slo_tpot_s: float,
) -> RunResult:
    ttft = [r.metrics.ttft for r, _ in requests if r.metrics.ttft is not None]
    tpot = [r.metrics.mean_tpot for r, _ in requests if r.metrics.mean_tpot is not None]
    good = sum(
        1
        for r, _ in requests
        if r.metrics.ttft is not None
        and r.metrics.ttft <= slo_ttft_s
        and (r.metrics.mean_tpot or 0.0) <= slo_tpot_s
    )
    rec = recorder
    backed = max(rec.sum_backed_bytes, 1.0)
    metrics = engine.metrics()
    info = {
        "seconds": round(seconds, 2),
        "output_tokens_per_s": round(produced / seconds, 2),
        "peak_concurrent_sequences": rec.peak_running_sequences,
        "ttft_p50_s": _round(_percentile(ttft, 50)),
        "ttft_p99_s": _round(_percentile(ttft, 99)),
        "tpot_p50_s": _round(_percentile(tpot, 50)),
        "tpot_p99_s": _round(_percentile(tpot, 99)),
        "goodput_req_per_s": round(good / seconds, 3),
        "requests_meeting_slo": good,
        "kv_utilization": round(rec.utilization(), 4),
        "waste_pct": round(100 * rec.waste_fraction(), 2),
        "reserved_minus_live_pct_of_reserved": round(
            100 * (rec.sum_reserved_bytes - rec.sum_live_bytes) / max(rec.sum_reserved_bytes, 1),
            2,
        ),
        "internal_fragmentation_pct": round(100 * rec.sum_internal_fragmentation_bytes / backed, 2),
        "reservation_waste_pct": round(100 * rec.sum_reservation_waste_bytes / backed, 2),
        "peak_backed_mib": round(rec.peak_backed_bytes / 2**20, 3),
        "peak_live_mib": round(rec.peak_live_bytes / 2**20, 3),
        "kv_budget_mib": round(
            engine.block_manager.num_device_blocks * engine.model_info.kv_bytes_per_block / 2**20,
            3,
        ),
        "page_faults": rec.page_faults,
        "decommit_ranges": rec.decommit_ranges,
        "preemptions": metrics.preemptions,
        "forward_seconds": round(rec.forward_seconds, 2),
        "steps": metrics.num_steps,
        "prefix_hit_rate": round(metrics.prefix_cache_hit_rate, 4),
    }
    t0 = rec.samples[0].time if rec.samples else 0.0
    timeline = {
        "time_s": [s.time - t0 for s in rec.samples],
        "backed_mib": [s.backed_bytes / 2**20 for s in rec.samples],
        "live_mib": [s.live_bytes / 2**20 for s in rec.samples],
        "reserved_mib": [s.reserved_bytes / 2**20 for s in rec.samples],
        "measured_time_s": [t - t0 for t, _ in rec.measured_backed_bytes],
        "measured_backed_mib": [b / 2**20 for _, b in rec.measured_backed_bytes],
    }
    return RunResult(
        layout, block_size, workload.name, seconds, produced, ttft, tpot, info, timeline
    )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
