"""Tiny random HF models of every family beyond Llama's (`benchmarks.tiny_models` builds them; the
families benchmark uses them too), and the cases the sharded family tests run."""

from benchmarks.tiny_models import COMMON, FAMILY_MODELS, write_family_model

__all__ = ["COMMON", "FAMILY_CASES", "FAMILY_MODELS", "write_family_model"]

FAMILY_CASES = [(name, False) for name in sorted(FAMILY_MODELS)] + [
    ("mixtral", True),
    ("qwen3_moe", True),
]
"""(family, expert parallel) cases of the sharded tests: every family split by columns, and the
mixture-of-experts ones also by whole experts."""
