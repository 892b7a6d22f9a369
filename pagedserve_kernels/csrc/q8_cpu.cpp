// y = x W^T for W stored as 8-bit codes with a float32 scale per block of 32 weights of a row
// (GGUF's Q8_0 layout: w = scale * q, q in -128..127), on x86-64 with AVX2 and FMA or AVX-512.
// Meant for an LM head whose checkpoint is Q8_0 (the default model's tied embedding): a decode
// step's few rows against a wide vocabulary.
//
// Built by pip at install time (setup.py) as a plain shared library with a C ABI, loaded by
// pagedserve_kernels/q8_cpu.py through ctypes after torch. Compiled for generic x86-64: the body
// (q8_tile.inc, over vec16.inc's Vec16) is compiled once per instruction set in its own
// `#pragma GCC target` region, and the caller names the set (`q8_isa_supported`).
//
// Exactness: Q8_0 scales are float16 values, so scale * q (an 11-bit significand times an 8-bit
// integer) is exact in float32: each weight used is bit-identical to the dequantized float32
// weight, and the product equals a float32 matmul over them up to the order of float32
// summation. x and the result are float32.
//
// Work split: output columns in strips of 4 spread over the calling thread's OpenMP team (torch's
// libgomp, shared by soname); rows in tiles of up to 4, the weights dequantized in registers
// once per tile: with AVX-512 against the whole strip, with AVX2 (half the registers, half as
// wide) 1 row against the whole strip, 2 against two columns at a time, 3-4 against one.
#include "cpu_common.h"
#include "cpu_kernels.h"

#include <immintrin.h>
#include <stdint.h>

namespace {
constexpr int kBlock = 32;
}  // namespace

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw")
namespace isa_avx512 {
namespace {
#define VEC16_AVX512 1
#include "vec16.inc"
#undef VEC16_AVX512
constexpr int kTileRows = 4;
constexpr int columns_at_once(int) { return 4; }
#include "q8_tile.inc"
}  // namespace
}  // namespace isa_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace isa_avx2 {
namespace {
#define VEC16_AVX512 0
#include "vec16.inc"
#undef VEC16_AVX512
constexpr int kTileRows = 4;
constexpr int columns_at_once(int rows) { return rows == 1 ? 4 : rows == 2 ? 2 : 1; }
#include "q8_tile.inc"
}  // namespace
}  // namespace isa_avx2
#pragma GCC pop_options

extern "C" {

// 1 when this CPU runs q8_matmul with instruction set `isa` (cpu_common::Isa), else 0.
int q8_isa_supported(int isa) { return cpu_common::isa_supported(isa) ? 1 : 0; }

// 1 when this CPU runs q8_matmul with some instruction set (AVX2 and FMA at least), else 0.
int q8_supported(void) { return q8_isa_supported(cpu_common::kAvx2); }

// out[M, N] = x[M, K] . W[N, K]^T with instruction set `isa`, W given as codes [N, K] (int8) and
// scales [N, K / 32] (float32); x and out float32; every buffer contiguous. Returns 0, or -1 for
// a K that is not a positive multiple of 32, -2 where the CPU lacks `isa`.
int q8_matmul(int isa, const float* x, int64_t M, int64_t K, const int8_t* codes,
              const float* scales, int64_t N, float* out) {
  if (K <= 0 || K % kBlock != 0 || M < 0 || N < 0) return -1;
  if (!cpu_common::isa_supported(isa)) return -2;
  if (isa == cpu_common::kAvx512)
    isa_avx512::multiply(x, M, K, codes, scales, N, out);
  else
    isa_avx2::multiply(x, M, K, codes, scales, N, out);
  return 0;
}

}  // extern "C"
