"""Weight bytes a decode step reads, per decoded token, against the machine's memory bandwidth.

A decode step of a model too large for the caches reads every weight once, whatever its batch,
so bytes per decoded token = the step's weight bytes / the tokens it decodes; at the machine's
read bandwidth that bounds the step rate. The serving and offline benchmarks report, per side:

- `read_bandwidth_gbs()`: this machine's memory read bandwidth, measured here (the best of a
  few `torch.sum` passes over a float32 tensor far larger than the caches, on torch's threads);
- `gguf_step_bytes(path)`: what a runtime that multiplies the file's own blocks reads per step
  (llama.cpp): every matrix, the tied embedding once as the head;
- `model_step_bytes(model, rows)`: what our loaded model reads per step of `rows` rows, from the
  form each product takes at that size (int8 panels, the 4-bit copy, the packed dense weight;
  the head's 8-bit copy, int8 panels or its dense weight);
- `traffic(step_bytes, tokens, steps, elapsed_s, bandwidth)`: bytes per decoded token and the
  weight stream the run sustained, as a fraction of the bandwidth.

Invariant: figures are bytes of weights only (no KV cache, no activations); a step that prefills
counts as a step.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import gguf
import torch


def read_bandwidth_gbs(mib: int = 1024, rounds: int = 5) -> float:
    """GB/s of the fastest of `rounds` sums over `mib` MiB of float32 (1e9 bytes per GB)."""
    values = torch.ones(mib * 1024 * 1024 // 4, dtype=torch.float32)
    values.sum()  # faults the pages in
    best = float("inf")
    for _ in range(rounds):
        began = time.perf_counter()
        values.sum()
        best = min(best, time.perf_counter() - began)
    return values.numel() * 4 / best / 1e9


def gguf_step_bytes(path: Path) -> int:
    """Bytes of the file's matrices a decode step reads: every 2-D tensor except the token
    embedding, which counts only when it is also the head (no `output.weight`)."""
    reader = gguf.GGUFReader(str(path))
    names = {tensor.name for tensor in reader.tensors}
    total = 0
    for tensor in reader.tensors:
        if len(tensor.shape) < 2:
            continue
        if tensor.name == "token_embd.weight" and "output.weight" in names:
            continue
        total += int(tensor.n_bytes)
    return total


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _form_bytes(form: Any) -> int:
    return _nbytes(t for t in vars(form).values() if isinstance(t, torch.Tensor))


def model_step_bytes(model: torch.nn.Module, rows: int) -> int:
    """Bytes our loaded `model` reads per step of `rows` rows (see the module doc)."""
    from workers.dense_matmul import Q4_MAX_ROWS, DenseMatmul
    from workers.layers import Q8_MAX_ROWS

    total = 0
    for module in model.modules():
        matmul = getattr(module, "matmul", None)
        if isinstance(matmul, DenseMatmul):
            weight = matmul.weight
            if matmul.panels is not None:
                total += _form_bytes(matmul.panels)
            elif matmul.q4 is not None and rows <= Q4_MAX_ROWS.get(weight.dtype, 0):
                total += _form_bytes(matmul.q4)
            else:
                total += weight.numel() * weight.element_size()
    head = getattr(model, "lm_head", None)
    if head is not None:
        if getattr(head, "q8", None) is not None and rows <= Q8_MAX_ROWS:
            total += _form_bytes(head.q8)
        elif getattr(head, "int8_head", None) is not None:
            total += _form_bytes(head.int8_head.panels)
        elif getattr(head, "screen", None) is not None:
            total += head.weight.numel() * 2  # the screened head reads a bfloat16 copy
        else:
            total += head.weight.numel() * head.weight.element_size()
    return total


def traffic(
    step_bytes: int | None, tokens: int, steps: int, elapsed_s: float, bandwidth_gbs: float
) -> dict[str, Any]:
    """Bytes per decoded token and the weight stream sustained over a run of `steps` steps that
    decoded `tokens` tokens in `elapsed_s` seconds."""
    if step_bytes is None or steps <= 0 or tokens <= 0 or elapsed_s <= 0:
        return {"weight_bytes_per_step": step_bytes}
    per_token = step_bytes * steps / tokens
    sustained = step_bytes * steps / elapsed_s / 1e9
    return {
        "weight_bytes_per_step": step_bytes,
        "tokens_per_step": round(tokens / steps, 2),
        "weight_bytes_per_token": round(per_token),
        "weight_stream_gbs": round(sustained, 2),
        "weight_stream_over_bandwidth": round(sustained / bandwidth_gbs, 3),
    }


def prometheus_counter(text: str, name: str) -> float:
    """The sum over label sets of counter `name` in a Prometheus text page (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        metric, _, value = line.rpartition(" ")
        if metric.split("{", 1)[0] in (name, f"{name}_total"):
            total += float(value)
    return total
