"""OpenVINO GenAI's side of `benchmarks.vs_openvino`, run by the OpenVINO venv's own Python.

Imports only the standard library, numpy and openvino_genai (never this project): reads a JSON
file `{"model": path.gguf, "prompts": [[token ids]...], "max_tokens": N, "warmup": [[ids]],
"properties": {CPU plugin properties}}`, builds `ContinuousBatchingPipeline(model,
SchedulerConfig(), "CPU", properties)` with prefix caching on,
generates greedily with EOS ignored, and prints one JSON object: wall seconds of the timed
generate call, output token ids per prompt, and the scheduler settings used.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import openvino as ov
import openvino_genai as genai


def generate(pipe: genai.ContinuousBatchingPipeline, prompts: list[list[int]], max_tokens: int):
    config = genai.GenerationConfig()
    config.max_new_tokens = max_tokens
    config.min_new_tokens = max_tokens
    config.ignore_eos = True
    config.do_sample = False
    tensors = [ov.Tensor(np.array([ids], dtype=np.int64)) for ids in prompts]
    return pipe.generate(tensors, [config] * len(prompts))


def main() -> int:
    with open(sys.argv[1]) as handle:
        spec = json.load(handle)
    scheduler = genai.SchedulerConfig()
    scheduler.enable_prefix_caching = True
    began = time.perf_counter()
    pipe = genai.ContinuousBatchingPipeline(
        spec["model"], scheduler, "CPU", spec.get("properties", {})
    )
    load_s = time.perf_counter() - began
    generate(pipe, spec["warmup"], 8)
    began = time.perf_counter()
    results = generate(pipe, spec["prompts"], spec["max_tokens"])
    elapsed = time.perf_counter() - began
    outputs = [list(result.m_generation_ids[0]) for result in results]
    print(
        json.dumps(
            {
                "elapsed_s": elapsed,
                "load_s": load_s,
                "outputs": outputs,
                "scheduler": {
                    "max_num_batched_tokens": scheduler.max_num_batched_tokens,
                    "max_num_seqs": scheduler.max_num_seqs,
                    "enable_prefix_caching": scheduler.enable_prefix_caching,
                    "dynamic_split_fuse": scheduler.dynamic_split_fuse,
                },
                "openvino_genai": genai.__version__,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
