// Helpers shared by the native CPU libraries (q4_cpu.cpp, q8_cpu.cpp, attention_cpu.cpp,
// layer_ops_cpu.cpp, decoder_stack_cpu.cpp): the instruction sets their vector code is compiled
// for and the CPU check, and bfloat16 conversions as torch does them. The vector operations
// themselves are in vec16.inc.
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

namespace cpu_common {

// The instruction sets each library's kernels are compiled for (the numbers of the C ABI's `isa`
// argument): AVX2 with FMA (two 256-bit halves a Vec16), AVX-512 F and BW (one 512-bit register).
enum Isa : int { kAvx2 = 1, kAvx512 = 2 };

// Whether this CPU runs the kernels compiled for instruction set `isa`.
inline bool isa_supported(int isa) {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  switch (isa) {
    case kAvx2: return avx2;
    case kAvx512:
      return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    default: return false;
  }
}

// A bfloat16 value widened to float32 (exact).
inline float bf16_to_float(uint16_t bits) {
  uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  memcpy(&value, &widened, sizeof(value));
  return value;
}

// float32 rounded to bfloat16, to nearest even; NaN becomes 0x7fc0, as torch rounds.
inline uint16_t float_to_bf16(float value) {
  uint32_t bits;
  memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  const uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

}  // namespace cpu_common
