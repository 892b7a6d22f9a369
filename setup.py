"""Builds the project's one native piece, the CPU 4-bit matmul (kernels/csrc/q4_cpu.cpp), at
install time with the machine's C++ compiler. Everything else is in pyproject.toml.

The library has a plain C ABI (no Python headers needed) and is loaded with ctypes. It is
optional: where it cannot be built the install still succeeds and the dense product is used
(`kernels.q4_cpu.available()` says which).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kernels._q4_cpu",
            sources=["kernels/csrc/q4_cpu.cpp"],
            language="c++",
            extra_compile_args=["-O3", "-std=c++17", "-fopenmp"],
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    ]
)
