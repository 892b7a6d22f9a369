// The elementwise work of a decoder layer in one call each, on x86-64 with AVX-512: the residual
// add with the RMS norm after it, rotary embeddings of the query and key heads with the KV write,
// and the gated MLP's silu(gate) * up. In plain torch each is 3-20 small operator calls a layer,
// which at decode sizes cost more in dispatch than in arithmetic.
//
// Built by pip at install time (setup.py) as a plain shared library with a C ABI, loaded by
// kernels/layer_ops_cpu.py through ctypes after torch.
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

#define OPS_TARGET __attribute__((target("avx512f,avx512bw")))

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

// 16 values at base[index] (float32, or bfloat16 widened exactly) as float32.
OPS_TARGET inline __m512 load16(const void* base, int bf16, int64_t index) {
  if (bf16) return cpu_common::load_bf16x16(static_cast<const uint16_t*>(base) + index);
  return _mm512_loadu_ps(static_cast<const float*>(base) + index);
}

// Stores 16 float32 values at base[index], rounded to bfloat16 (nearest even, NaN as torch's
// 0x7fc0) when bf16.
OPS_TARGET inline void store16(void* base, int bf16, int64_t index, __m512 value) {
  if (!bf16) {
    _mm512_storeu_ps(static_cast<float*>(base) + index, value);
    return;
  }
  const __m512i bits = _mm512_castps_si512(value);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(base) + index),
                      _mm512_cvtepi32_epi16(rounded));
}

// residual[hidden] += delta (when given); out = weight * residual / sqrt(mean(residual^2) + eps).
OPS_TARGET void add_rms_norm_row(float* residual, const void* delta, int delta_bf16,
                                 const void* weight, int weight_bf16, float eps, int64_t hidden,
                                 void* out, int out_bf16) {
  __m512 squares = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= hidden; i += 16) {
    __m512 x = _mm512_loadu_ps(residual + i);
    if (delta != nullptr) {
      x = _mm512_add_ps(x, load16(delta, delta_bf16, i));
      _mm512_storeu_ps(residual + i, x);
    }
    squares = _mm512_fmadd_ps(x, x, squares);
  }
  float sum = _mm512_reduce_add_ps(squares);
  for (; i < hidden; ++i) {
    if (delta != nullptr) residual[i] += load(delta, delta_bf16, i);
    sum += residual[i] * residual[i];
  }
  const float inverse = 1.0f / sqrtf(sum / static_cast<float>(hidden) + eps);
  const __m512 scale = _mm512_set1_ps(inverse);
  int64_t j = 0;
  for (; j + 16 <= hidden; j += 16) {
    const __m512 normalized = _mm512_mul_ps(_mm512_loadu_ps(residual + j), scale);
    store16(out, out_bf16, j, _mm512_mul_ps(load16(weight, weight_bf16, j), normalized));
  }
  for (; j < hidden; ++j)
    store(out, out_bf16, j, load(weight, weight_bf16, j) * (residual[j] * inverse));
}

// One head of head_dim values from qkv[source], rotated by cos / sin, to target[base].
OPS_TARGET void rotate_head(const void* qkv, int bf16, int64_t source, const float* cos,
                            const float* sin, int64_t head_dim, void* target, int64_t base) {
  const int64_t half = head_dim / 2;
  if (half % 16 == 0) {
    for (int64_t d = 0; d < half; d += 16) {
      const __m512 low = load16(qkv, bf16, source + d);
      const __m512 high = load16(qkv, bf16, source + half + d);
      // [low, high] -> [low * cos - high * sin, high * cos + low * sin]
      const __m512 new_low = _mm512_fnmadd_ps(high, _mm512_loadu_ps(sin + d),
                                              _mm512_mul_ps(low, _mm512_loadu_ps(cos + d)));
      const __m512 new_high =
          _mm512_fmadd_ps(low, _mm512_loadu_ps(sin + half + d),
                          _mm512_mul_ps(high, _mm512_loadu_ps(cos + half + d)));
      store16(target, bf16, base + d, new_low);
      store16(target, bf16, base + half + d, new_high);
    }
    return;
  }
  for (int64_t d = 0; d < head_dim; ++d) {
    const float x = load(qkv, bf16, source + d);
    const float rotated =
        d < half ? -load(qkv, bf16, source + d + half) : load(qkv, bf16, source + d - half);
    store(target, bf16, base + d, x * cos[d] + rotated * sin[d]);
  }
}

// out[row] = silu(gate) * up for one row of gate_up ([gate | up], 2 * width values).
OPS_TARGET void silu_mul_row(const void* gate_up, int bf16, int64_t row, int64_t width,
                             void* out) {
  const int64_t gates = row * 2 * width, ups = gates + width, outs = row * width;
  const __m512 one = _mm512_set1_ps(1.0f);
  int64_t j = 0;
  for (; j + 16 <= width; j += 16) {
    const __m512 gate = load16(gate_up, bf16, gates + j);
    const __m512 negated = _mm512_sub_ps(_mm512_setzero_ps(), gate);
    const __m512 silu = _mm512_div_ps(gate, _mm512_add_ps(one, cpu_common::exp_ps(negated)));
    store16(out, bf16, outs + j, _mm512_mul_ps(silu, load16(gate_up, bf16, ups + j)));
  }
  for (; j < width; ++j) {
    const float gate = load(gate_up, bf16, gates + j);
    store(out, bf16, outs + j, gate / (1.0f + expf(-gate)) * load(gate_up, bf16, ups + j));
  }
}

}  // namespace

extern "C" {

// 1 when this CPU runs these functions (AVX-512 F and BW), else 0.
int layer_ops_supported(void) { return cpu_common::avx512_supported(); }

// For each of `rows` rows of `hidden` values (all buffers contiguous): residual += delta (when
// delta is not null; float32, or bfloat16 when delta_bf16), then out = weight * residual *
// rsqrt(mean(residual^2) + eps), out and weight float32 or bfloat16 (out_bf16, weight_bf16).
// Returns 0, -2 where the CPU lacks AVX-512.
int add_rms_norm(float* residual, const void* delta, int delta_bf16, const void* weight,
                 int weight_bf16, float eps, int64_t rows, int64_t hidden, void* out,
                 int out_bf16) {
  if (!layer_ops_supported()) return -2;
  const size_t out_size = out_bf16 ? 2 : 4, delta_size = delta_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (rows * hidden >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    const void* delta_row =
        delta == nullptr ? nullptr : static_cast<const char*>(delta) + r * hidden * delta_size;
    add_rms_norm_row(residual + r * hidden, delta_row, delta_bf16, weight, weight_bf16, eps,
                     hidden, static_cast<char*>(out) + r * hidden * out_size, out_bf16);
  }
  return 0;
}

// Rotary embeddings (rotate-half layout) and the KV write of `tokens` rows of a fused QKV
// projection: row t (qkv + t * qkv_row_stride elements) holds num_q query heads, then num_kv key
// heads, then num_kv value heads, of head_dim each. cos and sin are float32 [tokens, head_dim].
// Query head h goes to q_out[t, h] (contiguous [tokens, num_q, head_dim]); the rotated keys and
// the values go to slot slots[t] of k_cache / v_cache ([slots, num_kv, head_dim], contiguous),
// skipped when slots[t] < 0. qkv, q_out and the caches share one dtype (bf16: bfloat16, else
// float32). The caller validates the slots. Returns 0, -1 for an odd head_dim, -2 where the CPU
// lacks AVX-512.
int rotary_write_kv(const void* qkv, int64_t qkv_row_stride, int bf16, int64_t tokens,
                    int64_t num_q, int64_t num_kv, int64_t head_dim, const float* cos,
                    const float* sin, const int64_t* slots, void* k_cache, void* v_cache,
                    void* q_out) {
  if (head_dim <= 0 || head_dim % 2 != 0) return -1;
  if (!layer_ops_supported()) return -2;
  const int64_t width = (num_q + 2 * num_kv) * head_dim;
#pragma omp parallel for schedule(static) if (tokens * width >= kParallelElements)
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t row = t * qkv_row_stride;
    const float* c = cos + t * head_dim;
    const float* s = sin + t * head_dim;
    const int64_t slot = slots[t];
    for (int64_t h = 0; h < num_q + num_kv; ++h) {
      const bool is_query = h < num_q;
      if (!is_query && slot < 0) continue;
      const int64_t source = row + h * head_dim;
      void* target = is_query ? q_out : k_cache;
      const int64_t base =
          is_query ? (t * num_q + h) * head_dim : (slot * num_kv + (h - num_q)) * head_dim;
      rotate_head(qkv, bf16, source, c, s, head_dim, target, base);
    }
    if (slot < 0) continue;
    const size_t element = bf16 ? 2 : 4;
    memcpy(static_cast<char*>(v_cache) + slot * num_kv * head_dim * element,
           static_cast<const char*>(qkv) + (row + (num_q + num_kv) * head_dim) * element,
           num_kv * head_dim * element);
  }
  return 0;
}

// out[r, j] = silu(gate_up[r, j]) * gate_up[r, width + j] for `rows` contiguous rows of
// 2 * width values; out contiguous [rows, width]; both float32, or bfloat16 when bf16.
// Returns 0, -2 where the CPU lacks AVX-512.
int silu_mul(const void* gate_up, int bf16, int64_t rows, int64_t width, void* out) {
  if (!layer_ops_supported()) return -2;
#pragma omp parallel for schedule(static) if (rows * width >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) silu_mul_row(gate_up, bf16, r, width, out);
  return 0;
}

}  // extern "C"
