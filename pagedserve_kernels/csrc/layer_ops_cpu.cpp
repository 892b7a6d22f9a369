// The elementwise work of a decoder layer in one call each, on x86-64 with AVX2 and FMA or
// AVX-512: the residual add with the RMS norm after it, rotary embeddings of the query and key
// heads with the KV write, and the gated MLP's silu(gate) * up. In plain torch each is 3-20 small
// operator calls a layer, which at decode sizes cost more in dispatch than in arithmetic.
//
// Built by pip at install time (setup.py) as a plain shared library with a C ABI, loaded by
// pagedserve_kernels/layer_ops_cpu.py through ctypes after torch. Compiled for generic x86-64: the row
// functions (layer_ops_rows.inc, over vec16.inc's Vec16) are compiled once per instruction set
// in its own `#pragma GCC target` region, and the caller names the set
// (`layer_ops_isa_supported`); both give the same bits except for the norm's sum of squares
// (summation order).
//
// Numerics: every value is widened to float32 (bfloat16 exactly), computed in float32 and rounded
// once to its destination's dtype (bfloat16 to nearest even, as torch rounds). Plain torch in
// bfloat16 rounds between the operators (the normalized row before the norm's weight, cos and
// sin, each rotary product); these round only the result, so they are at least as exact.
//
// Rows are spread over the calling thread's OpenMP team (the libgomp.so.1 torch loaded, shared by
// soname) only when a call is large enough to pay for waking it (prefill chunks); decode-sized
// calls run on the calling thread.
#include "cpu_common.h"
#include "cpu_kernels.h"

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

namespace {

using cpu_common::bf16_to_float;
using cpu_common::float_to_bf16;

constexpr int64_t kParallelElements = 1 << 16;

inline float load(const void* base, int bf16, int64_t index) {
  return bf16 ? bf16_to_float(static_cast<const uint16_t*>(base)[index])
              : static_cast<const float*>(base)[index];
}

inline void store(void* base, int bf16, int64_t index, float value) {
  if (bf16) {
    static_cast<uint16_t*>(base)[index] = float_to_bf16(value);
  } else {
    static_cast<float*>(base)[index] = value;
  }
}

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw")
namespace isa_avx512 {
namespace {
#define VEC16_AVX512 1
#include "vec16.inc"
#undef VEC16_AVX512
#include "layer_ops_rows.inc"
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
#include "layer_ops_rows.inc"
}  // namespace
}  // namespace isa_avx2
#pragma GCC pop_options

extern "C" {

// 1 when this CPU runs these functions with instruction set `isa` (cpu_common::Isa), else 0.
int layer_ops_isa_supported(int isa) { return cpu_common::isa_supported(isa) ? 1 : 0; }

// 1 when this CPU runs these functions with some instruction set (AVX2 and FMA at least).
int layer_ops_supported(void) { return layer_ops_isa_supported(cpu_common::kAvx2); }

// For each of `rows` rows of `hidden` values (all buffers contiguous): residual += delta (when
// delta is not null; float32, or bfloat16 when delta_bf16), then out = weight * residual *
// rsqrt(mean(residual^2) + eps), out and weight float32 or bfloat16 (out_bf16, weight_bf16).
// Returns 0, -2 where the CPU lacks `isa`.
int add_rms_norm(int isa, float* residual, const void* delta, int delta_bf16, const void* weight,
                 int weight_bf16, float eps, int64_t rows, int64_t hidden, void* out,
                 int out_bf16) {
  if (!cpu_common::isa_supported(isa)) return -2;
  if (isa == cpu_common::kAvx512)
    isa_avx512::add_rms_norm_rows(residual, delta, delta_bf16, weight, weight_bf16, eps, rows,
                                  hidden, out, out_bf16);
  else
    isa_avx2::add_rms_norm_rows(residual, delta, delta_bf16, weight, weight_bf16, eps, rows,
                                hidden, out, out_bf16);
  return 0;
}

// Rotary embeddings (rotate-half layout) and the KV write of `tokens` rows of a fused QKV
// projection: row t (qkv + t * qkv_row_stride elements) holds num_q query heads, then num_kv key
// heads, then num_kv value heads, of head_dim each. cos and sin are float32 [tokens, head_dim].
// Query head h goes to q_out[t, h] (contiguous [tokens, num_q, head_dim]); the rotated keys and
// the values go to slot slots[t] of k_cache / v_cache ([slots, num_kv, head_dim], contiguous),
// skipped when slots[t] < 0. qkv, q_out and the caches share one dtype (bf16: bfloat16, else
// float32). The caller validates the slots. Returns 0, -1 for an odd head_dim, -2 where the CPU
// lacks `isa`.
int rotary_write_kv(int isa, const void* qkv, int64_t qkv_row_stride, int bf16, int64_t tokens,
                    int64_t num_q, int64_t num_kv, int64_t head_dim, const float* cos,
                    const float* sin, const int64_t* slots, void* k_cache, void* v_cache,
                    void* q_out) {
  if (head_dim <= 0 || head_dim % 2 != 0) return -1;
  if (!cpu_common::isa_supported(isa)) return -2;
  if (isa == cpu_common::kAvx512)
    isa_avx512::rotary_write_kv_rows(qkv, qkv_row_stride, bf16, tokens, num_q, num_kv, head_dim,
                                     cos, sin, slots, k_cache, v_cache, q_out);
  else
    isa_avx2::rotary_write_kv_rows(qkv, qkv_row_stride, bf16, tokens, num_q, num_kv, head_dim,
                                   cos, sin, slots, k_cache, v_cache, q_out);
  return 0;
}

// out[r, j] = silu(gate_up[r, j]) * gate_up[r, width + j] for `rows` contiguous rows of
// 2 * width values; out contiguous [rows, width]; both float32, or bfloat16 when bf16.
// Returns 0, -2 where the CPU lacks `isa`.
int silu_mul(int isa, const void* gate_up, int bf16, int64_t rows, int64_t width, void* out) {
  if (!cpu_common::isa_supported(isa)) return -2;
  if (isa == cpu_common::kAvx512)
    isa_avx512::silu_mul_rows(gate_up, bf16, rows, width, out);
  else
    isa_avx2::silu_mul_rows(gate_up, bf16, rows, width, out);
  return 0;
}

}  // extern "C"
