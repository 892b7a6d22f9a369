"""Kernel tests run Triton in its CPU interpreter where no CUDA device exists.

The interpreter is chosen when a Triton kernel is defined, so the variable must be set before any
``pagedserve_kernels.triton_*`` module is imported; the Makefile sets it too.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
