"""The tests' tiny random Llama: `benchmarks.tiny_models` builds it (the benchmarks use it too),
re-exported here under the name every room's tests import."""

from benchmarks.tiny_models import SEED, TINY_LLAMA_CONFIG, make_tiny_llama, smollm2_tokenizer

__all__ = ["SEED", "TINY_LLAMA_CONFIG", "make_tiny_llama", "smollm2_tokenizer"]
