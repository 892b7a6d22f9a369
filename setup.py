"""Builds the project's native pieces at install time with the machine's C++ compiler: the CPU
4-bit matmul (kernels/csrc/q4_cpu.cpp), the CPU paged decode attention
(kernels/csrc/attention_cpu.cpp) and a decoder layer's elementwise work
(kernels/csrc/layer_ops_cpu.cpp). Everything else is in pyproject.toml.

Each library has a plain C ABI (no Python headers needed) and is loaded with ctypes. All are
optional: where one cannot be built the install still succeeds and the plain-torch path is used
(`available()` in kernels.q4_cpu, kernels.attention_cpu and kernels.layer_ops_cpu says which).
"""

from setuptools import Extension, setup


def native(name: str) -> Extension:
    """`kernels._<name>` from `kernels/csrc/<name>.cpp`, OpenMP on (torch's libgomp at run time)."""
    return Extension(
        f"kernels._{name}",
        sources=[f"kernels/csrc/{name}.cpp"],
        depends=["kernels/csrc/cpu_common.h"],
        language="c++",
        extra_compile_args=["-O3", "-std=c++17", "-fopenmp"],
        extra_link_args=["-fopenmp"],
        optional=True,
    )


setup(ext_modules=[native("q4_cpu"), native("attention_cpu"), native("layer_ops_cpu")])
