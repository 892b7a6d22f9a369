"""Tensor-parallel workers: model shards, KV pool shards, the CPU swap tier, one step per call."""
