// y = x W^T for W stored as 4-bit codes with a float32 scale and minimum per block of 32 weights
// of a row (GGUF's Q4_1 layout: w = scale * q + min, q in 0..15), on x86-64 with AVX2 and FMA
// or AVX-512.
//
// Built by pip at install time (setup.py) as a plain shared library with a C ABI, loaded by
// pagedserve_kernels/q4_cpu.py through ctypes after torch. Compiled for generic x86-64: the body
// (q4_tile.inc, over vec16.inc's Vec16) is compiled once per instruction set in its own
// `#pragma GCC target` region, and the caller names the set (`q4_isa_supported`); a CPU without
// AVX2 and FMA runs none.
//
// Exactness: each weight is dequantized in float32 with one fused multiply-add. For Q4_1,
// scale * q is exact in float32 (an 11-bit fp16 scale times a 4-bit code), so that is the single
// rounding of `scale * q + min` that GGUF's dequantizer performs too: the weights used are
// bit-identical to the dequantized float32 weights, and the product equals a float32 matmul over
// them up to the order of float32 summation. Activations are float32 or bfloat16 (widened
// exactly); the result is float32 or bfloat16 (rounded to nearest even, as torch rounds).
//
// Work split: output columns in strips of 4, strips spread over the calling thread's OpenMP
// team (the libgomp.so.1 torch loaded, shared by soname, so the same team and thread count
// torch uses from that thread). Rows go in tiles, each against as many of the strip's columns at
// once as keep its accumulators in registers: with AVX-512 (32 registers of 16 floats) tiles of
// up to 8 rows, up to 4 rows against a whole strip and 5-8 against two columns at a time; with
// AVX2 (16 registers of 8 floats, a Vec16 taking two) tiles of up to 4 rows, a row against the
// whole strip, 2 rows against two columns and 3-4 against one. The weights are dequantized in
// registers for every tile, which suits the decode batches it is meant for; larger batches
// belong to a dense kernel.
#include "cpu_common.h"
#include "cpu_kernels.h"

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

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
constexpr int kTileRows = 8;
constexpr bool kHoistRows = true;
constexpr int columns_at_once(int rows) { return rows <= 4 ? 4 : 2; }
#include "q4_tile.inc"
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
constexpr bool kHoistRows = false;
constexpr int columns_at_once(int rows) { return rows == 1 ? 4 : rows == 2 ? 2 : 1; }
#include "q4_tile.inc"
}  // namespace
}  // namespace isa_avx2
#pragma GCC pop_options

extern "C" {

// 1 when this CPU runs q4_matmul with instruction set `isa` (cpu_common::Isa), else 0.
int q4_isa_supported(int isa) { return cpu_common::isa_supported(isa) ? 1 : 0; }

// 1 when this CPU runs q4_matmul with some instruction set (AVX2 and FMA at least), else 0.
int q4_supported(void) { return q4_isa_supported(cpu_common::kAvx2); }

// out[M, N] = x[M, K] . W[N, K]^T with instruction set `isa`, W given as codes [N, K / 2]
// (uint8), scales and mins [N, K / 32] (float32); every buffer contiguous. x is float32, or
// bfloat16 when x_bf16, in which case `widened` must hold M * K float32 (scratch). Returns 0, or
// -1 for a K that is not a positive multiple of 32, -2 where the CPU lacks `isa`.
int q4_matmul(int isa, const void* x, int x_bf16, float* widened, int64_t M, int64_t K,
              const uint8_t* codes, const float* scales, const float* mins, int64_t N, void* out,
              int out_bf16) {
  if (K <= 0 || K % kBlock != 0 || M < 0 || N < 0) return -1;
  if (!cpu_common::isa_supported(isa)) return -2;
  const float* x_f32 = static_cast<const float*>(x);
  if (x_bf16) {
    const uint16_t* source = static_cast<const uint16_t*>(x);
    for (int64_t i = 0; i < M * K; ++i) widened[i] = cpu_common::bf16_to_float(source[i]);
    x_f32 = widened;
  }
  if (isa == cpu_common::kAvx512)
    isa_avx512::multiply(x_f32, M, K, codes, scales, mins, N, out, out_bf16 != 0);
  else
    isa_avx2::multiply(x_f32, M, K, codes, scales, mins, N, out, out_bf16 != 0);
  return 0;
}

}  // extern "C"
