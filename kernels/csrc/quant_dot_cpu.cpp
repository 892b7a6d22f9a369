// y = x W^T with x quantized to 8 bits per row-block of 32 and W kept as unsigned 4- or 8-bit
// codes with a float32 scale and minimum per block of 32 (w = scale * u + min): integer dot
// products, the way llama.cpp multiplies GGUF weights (its Q8_1 activations against Q4_x/Q8_0).
//
// Built by pip at install time (setup.py) as a plain shared library with a C ABI, loaded by
// kernels/quant_dot_cpu.py through ctypes after torch. Compiled for generic x86-64: each
// instruction set's kernel is its own `#pragma GCC target` region, chosen at run time
// (`quant_dot_isa_supported`); a CPU without AVX2 runs none of them.
//
// Activations: per row and block of 32, d = max|x| / 127, a = round_half_even(x * (1 / d))
// in -127..127 (a = 0 where d = 0), and s = d * sum(a). Exactly those float32 operations, so a
// plain-torch reference reproduces the codes bit for bit.
//
// Product, per output and block b: the int32 sum of u * a (exact), then
// acc = fma(float(isum), scale * d, acc) and acc = fma(min, s, acc), blocks in order. The
// result is not the float32 product over the dequantized weights: each activation is rounded
// to its block's 8-bit grid (an error of at most d / 2 per element).
//
// Weight layout (`kernels/quant_dot_cpu.py` repacks to it once): columns in panels of 16
// (padded to an even number of panels); per panel and block, 4-bit codes as 4 chunks of 64
// bytes, byte 4c + j of chunk t holding column c's codes k = 4t + j (low nibble) and
// k = 16 + 4t + j (high nibble); 8-bit codes as 8 steps of 64 bytes, byte 4c + j of step s
// holding column c's code k = 4s + j. Scales and minimums: 16 float32 per panel and block.
//
// Instruction sets: AVX-512 VNNI (vpdpbusd, 4 rows x 32 columns a tile), AVX-512 BW
// (vpmaddubsw + vpmaddwd), AVX-VNNI (256-bit vpdpbusd, 3 rows x 16 columns), AVX2. Without VNNI
// 8-bit codes are split in two nibbles so vpmaddubsw's 16-bit pair sums cannot saturate.
// Work split: items of (a chunk of rows, a group of panels) over the calling thread's OpenMP
// team (torch's libgomp, shared by soname).
#include "cpu_common.h"
#include "cpu_kernels.h"

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

namespace {

constexpr int kMaxRows = 4;
constexpr int kMaxColumns = 32;
constexpr int64_t kRowChunk = 64;

enum Isa { kNone = 0, kAvx2 = 1, kAvxVnni = 2, kAvx512Bw = 3, kAvx512Vnni = 4 };

bool isa_supported(int isa) {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512bw = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  switch (isa) {
    case kAvx2: return avx2;
    case kAvxVnni: return avx2 && __builtin_cpu_supports("avxvnni");
    case kAvx512Bw: return avx2 && avx512bw;
    case kAvx512Vnni: return avx2 && avx512bw && __builtin_cpu_supports("avx512vnni");
    default: return false;
  }
}

inline int32_t load4(const int8_t* p) {
  int32_t value;
  memcpy(&value, p, sizeof(value));
  return value;
}

}  // namespace

// ---- AVX-512 VNNI -------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vnni")
namespace isa_avx512_vnni {
namespace {
constexpr int kWidth = 16, kRows = 4, kGroupPanels = 2;
using VI = __m512i;
using VF = __m512;
inline VI zero() { return _mm512_setzero_si512(); }
inline VF zerof() { return _mm512_setzero_ps(); }
inline VI load(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline VI low_nibbles(VI v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0f)); }
inline VI high_nibbles(VI v) {
  return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f));
}
inline VI broadcast4(const int8_t* p) { return _mm512_set1_epi32(load4(p)); }
inline VI dot4(VI acc, VI w, VI a) { return _mm512_dpbusd_epi32(acc, w, a); }
inline VI dot8(VI acc, VI w, VI a) { return _mm512_dpbusd_epi32(acc, w, a); }
inline VF to_float(VI v) { return _mm512_cvtepi32_ps(v); }
inline VF loadf(const float* p) { return _mm512_loadu_ps(p); }
inline VF set1f(float v) { return _mm512_set1_ps(v); }
inline VF fmadd(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline void storef(float* p, VF v) { _mm512_storeu_ps(p, v); }
#include "quant_dot_tile.inc"
}  // namespace
}  // namespace isa_avx512_vnni
#pragma GCC pop_options

// ---- AVX-512 BW ---------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw")
namespace isa_avx512_bw {
namespace {
constexpr int kWidth = 16, kRows = 4, kGroupPanels = 2;
using VI = __m512i;
using VF = __m512;
inline VI zero() { return _mm512_setzero_si512(); }
inline VF zerof() { return _mm512_setzero_ps(); }
inline VI load(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline VI low_nibbles(VI v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0f)); }
inline VI high_nibbles(VI v) {
  return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f));
}
inline VI broadcast4(const int8_t* p) { return _mm512_set1_epi32(load4(p)); }
inline VI dot4(VI acc, VI w, VI a) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, a), _mm512_set1_epi16(1)));
}
inline VI dot8(VI acc, VI w, VI a) {
  const VI low = _mm512_madd_epi16(_mm512_maddubs_epi16(low_nibbles(w), a), _mm512_set1_epi16(1));
  const VI high =
      _mm512_madd_epi16(_mm512_maddubs_epi16(high_nibbles(w), a), _mm512_set1_epi16(16));
  return _mm512_add_epi32(acc, _mm512_add_epi32(low, high));
}
inline VF to_float(VI v) { return _mm512_cvtepi32_ps(v); }
inline VF loadf(const float* p) { return _mm512_loadu_ps(p); }
inline VF set1f(float v) { return _mm512_set1_ps(v); }
inline VF fmadd(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline void storef(float* p, VF v) { _mm512_storeu_ps(p, v); }
#include "quant_dot_tile.inc"
}  // namespace
}  // namespace isa_avx512_bw
#pragma GCC pop_options

// ---- AVX2 (and AVX-VNNI): 256-bit, the two halves of one panel ------------------------------
#define QUANT_DOT_AVX2_COMMON                                                                    \
  constexpr int kWidth = 8, kRows = 3, kGroupPanels = 1;                                       \
  using VI = __m256i;                                                                          \
  using VF = __m256;                                                                           \
  inline VI zero() { return _mm256_setzero_si256(); }                                          \
  inline VF zerof() { return _mm256_setzero_ps(); }                                            \
  inline VI load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const VI*>(p)); } \
  inline VI low_nibbles(VI v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0f)); }          \
  inline VI high_nibbles(VI v) {                                                               \
    return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f));                  \
  }                                                                                            \
  inline VI broadcast4(const int8_t* p) { return _mm256_set1_epi32(load4(p)); }                \
  inline VF to_float(VI v) { return _mm256_cvtepi32_ps(v); }                                   \
  inline VF loadf(const float* p) { return _mm256_loadu_ps(p); }                               \
  inline VF set1f(float v) { return _mm256_set1_ps(v); }                                       \
  inline VF fmadd(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }                       \
  inline VF mul(VF a, VF b) { return _mm256_mul_ps(a, b); }                                    \
  inline void storef(float* p, VF v) { _mm256_storeu_ps(p, v); }

#pragma GCC push_options
#pragma GCC target("avx2,fma,avxvnni")
namespace isa_avx_vnni {
namespace {
QUANT_DOT_AVX2_COMMON
inline VI dot4(VI acc, VI w, VI a) { return _mm256_dpbusd_avx_epi32(acc, w, a); }
inline VI dot8(VI acc, VI w, VI a) { return _mm256_dpbusd_avx_epi32(acc, w, a); }
#include "quant_dot_tile.inc"
}  // namespace
}  // namespace isa_avx_vnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace isa_avx2 {
namespace {
QUANT_DOT_AVX2_COMMON
inline VI dot4(VI acc, VI w, VI a) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1)));
}
inline VI dot8(VI acc, VI w, VI a) {
  const VI low = _mm256_madd_epi16(_mm256_maddubs_epi16(low_nibbles(w), a), _mm256_set1_epi16(1));
  const VI high =
      _mm256_madd_epi16(_mm256_maddubs_epi16(high_nibbles(w), a), _mm256_set1_epi16(16));
  return _mm256_add_epi32(acc, _mm256_add_epi32(low, high));
}
#include "quant_dot_tile.inc"
}  // namespace
}  // namespace isa_avx2

namespace {

// One row-block of 32 float32 values quantized (see the file comment); returns sum(a).
inline int32_t quantize_block(const float* x, int8_t* codes, float* scale) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float d = _mm_cvtss_f32(m) / 127.0f;
  const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
  *scale = d;
  __m256i q[4];
  __m256i sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {  // cvtps rounds to nearest even (the default MXCSR mode)
    q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inverse)));
    sum = _mm256_add_epi32(sum, q[i]);
  }
  const __m256i words = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                           _mm256_packs_epi32(q[2], q[3]));
  const __m256i ordered =
      _mm256_permutevar8x32_epi32(words, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes), ordered);
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// Called by every thread of an OpenMP team (or by one thread alone), which split the rows.
void quantize_rows(const void* x, bool x_bf16, int64_t M, int64_t K, int8_t* codes, float* dx,
                   float* sx) {
  const int64_t blocks = K / 32;
#pragma omp for schedule(static)
  for (int64_t r = 0; r < M; ++r) {
    float widened[32];
    for (int64_t b = 0; b < blocks; ++b) {
      const float* block = static_cast<const float*>(x) + r * K + b * 32;
      if (x_bf16) {
        const uint16_t* source = static_cast<const uint16_t*>(x) + r * K + b * 32;
        for (int i = 0; i < 32; ++i) widened[i] = cpu_common::bf16_to_float(source[i]);
        block = widened;
      }
      const int64_t index = r * blocks + b;
      const int32_t total = quantize_block(block, codes + r * K + b * 32, &dx[index]);
      sx[index] = dx[index] * static_cast<float>(total);
    }
  }
}

}  // namespace
#pragma GCC pop_options

extern "C" {

// 1 when this CPU runs the kernel of instruction set `isa` (1 AVX2, 2 AVX-VNNI, 3 AVX-512 BW,
// 4 AVX-512 VNNI), else 0.
int quant_dot_isa_supported(int isa) { return isa_supported(isa) ? 1 : 0; }

// 1 when this CPU runs any of the kernels (AVX2 and FMA), else 0.
int quant_dot_supported(void) { return quant_dot_isa_supported(kAvx2); }

// codes[M, K] (int8), dx and sx [M, K / 32] (float32): x[M, K] (float32, or bfloat16 when
// x_bf16) quantized per row-block (see the file comment). Returns 0, -1 for a K that is not a
// positive multiple of 32, -2 where the CPU lacks AVX2.
int quant_dot_quantize(const void* x, int x_bf16, int64_t M, int64_t K, int8_t* codes, float* dx,
                       float* sx) {
  if (K <= 0 || K % 32 != 0 || M < 0) return -1;
  if (!isa_supported(kAvx2)) return -2;
#pragma omp parallel if (M * K >= (1 << 15))
  quantize_rows(x, x_bf16 != 0, M, K, codes, dx, sx);
  return 0;
}

// out[M, N] (float32, or bfloat16 when out_bf16) = x[M, K] . W^T with x quantized into the
// scratch codes / dx / sx (sizes as quant_dot_quantize) and W in the panel layout (see the file
// comment) of `bits`-bit codes, multiplied with instruction set `isa`. Returns 0, -1 for bad
// sizes or bits, -2 where the CPU lacks `isa`.
int quant_dot_matmul(int isa, const void* x, int x_bf16, int64_t M, int64_t K, int8_t* codes,
                     float* dx, float* sx, const uint8_t* weight_codes, int bits,
                     const float* scales, const float* mins, int64_t N, void* out, int out_bf16) {
  if (K <= 0 || K % 32 != 0 || M < 0 || N < 0 || (bits != 4 && bits != 8)) return -1;
  if (!isa_supported(isa)) return -2;
  const bool bf16 = out_bf16 != 0;
#pragma omp parallel
  {  // one team for both passes: the rows are quantized (a barrier) before any product
    quantize_rows(x, x_bf16 != 0, M, K, codes, dx, sx);
    switch (isa) {
      case kAvx512Vnni:
        isa_avx512_vnni::matmul(codes, dx, sx, M, K, weight_codes, bits, scales, mins, N, out,
                                bf16);
        break;
      case kAvx512Bw:
        isa_avx512_bw::matmul(codes, dx, sx, M, K, weight_codes, bits, scales, mins, N, out,
                              bf16);
        break;
      case kAvxVnni:
        isa_avx_vnni::matmul(codes, dx, sx, M, K, weight_codes, bits, scales, mins, N, out, bf16);
        break;
      default:
        isa_avx2::matmul(codes, dx, sx, M, K, weight_codes, bits, scales, mins, N, out, bf16);
    }
  }
  return 0;
}

}  // extern "C"
