"""Builds the project's native pieces at install time with the machine's C++ compiler: the CPU
4-bit and 8-bit matmuls (pagedserve_kernels/csrc/q4_cpu.cpp, q8_cpu.cpp), the int8-activation
products over 4- and 8-bit weights (pagedserve_kernels/csrc/quant_dot_cpu.cpp), the CPU paged decode
attention (pagedserve_kernels/csrc/attention_cpu.cpp), a decoder layer's elementwise work
(pagedserve_kernels/csrc/layer_ops_cpu.cpp), and all but the 8-bit matmul chained into a decode
step's whole decoder stack (pagedserve_kernels/csrc/decoder_stack_cpu.cpp). Everything else is in
pyproject.toml.

Each library has a plain C ABI (no Python headers needed) and is loaded with ctypes. All are
optional: where one cannot be built the install still succeeds and the plain-torch path is used
(`available()` in pagedserve_kernels.q4_cpu, pagedserve_kernels.q8_cpu,
pagedserve_kernels.quant_dot_cpu, pagedserve_kernels.attention_cpu, pagedserve_kernels.layer_ops_cpu
and pagedserve_kernels.decoder_stack_cpu says which).
"""

from setuptools import Extension, setup

KERNELS = ["q4_cpu", "attention_cpu", "layer_ops_cpu"]


def native(name: str, linked: tuple[str, ...] = ()) -> Extension:
    """`pagedserve_kernels._<name>` from `pagedserve_kernels/csrc/<name>.cpp` (and the `linked`
    kernels' sources), OpenMP on (torch's libgomp at run time)."""
    return Extension(
        f"pagedserve_kernels._{name}",
        sources=[f"pagedserve_kernels/csrc/{source}.cpp" for source in (name, *linked)],
        depends=[
            f"pagedserve_kernels/csrc/{header}"
            for header in (
                "cpu_common.h",
                "cpu_kernels.h",
                "vec16.inc",
                "q4_tile.inc",
                "q8_tile.inc",
                "attention_body.inc",
                "layer_ops_rows.inc",
                "quant_dot_tile.inc",
            )
        ],
        language="c++",
        extra_compile_args=["-O3", "-std=c++17", "-fopenmp"],
        extra_link_args=["-fopenmp"],
        optional=True,
    )


setup(
    ext_modules=[
        *(native(name) for name in KERNELS),
        native("q8_cpu"),
        native("quant_dot_cpu"),
        native("decoder_stack_cpu", linked=(*KERNELS, "quant_dot_cpu")),
    ]
)
