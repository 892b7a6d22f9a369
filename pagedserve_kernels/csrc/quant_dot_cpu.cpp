// y = x W^T with x quantized to 8 bits per row-block of 32 and W kept as unsigned 4- or 8-bit
// codes with a float32 scale and minimum per block of 32 (w = scale * u + min): integer dot
// products, the way llama.cpp multiplies GGUF weights (its Q8_1 activations against Q4_x/Q8_0).
//
// Built by pip at install time (setup.py) as a plain shared library with a C ABI, loaded by
// pagedserve_kernels/quant_dot_cpu.py through ctypes after torch. Compiled for generic x86-64: each
// instruction set's kernel is its own `#pragma GCC target` region, chosen at run time
// (`quant_dot_isa_supported`); a CPU without AVX2 runs none of them.
//
// Activations: per row and block of 32, d = max|x| / 127, a = round_half_even(x * (1 / d))
// in -127..127 (a = 0 where d = 0), and s = d * sum(a). Exactly those float32 operations, so a
// plain-torch reference reproduces the codes bit for bit.
//
// Product, per output and scale group g (a block of 32; for 6-bit codes each half of one): the
// int32 sum of u * a (exact), then acc = fma(float(isum), scale * d, acc) and
// acc = fma(min, s, acc) with s = d * sum(a) over the group, groups in order. The result is not
// the float32 product over the dequantized weights: each activation is rounded to its block's
// 8-bit grid (an error of at most d / 2 per element).
//
// Weight layout (`pagedserve_kernels/quant_dot_cpu.py` repacks to it once): columns in panels of 16
// (padded to an even number of panels); per panel and block, 4-bit codes as 4 chunks of 64
// bytes, byte 4c + j of chunk t holding column c's codes k = 4t + j (low nibble) and
// k = 16 + 4t + j (high nibble); byte codes (`bits` 5, 6 or 8: codes below 2^bits) as 8 steps
// of 64 bytes, byte 4c + j of step s holding column c's code k = 4s + j. Scales and minimums:
// 16 float32 per panel and scale group (two groups per block for 6 bits, one otherwise).
//
// Instruction sets: AVX-512 VNNI (vpdpbusd, 4 rows x 32 columns a tile), AVX-512 BW
// (vpmaddubsw + vpmaddwd), AVX-VNNI (256-bit vpdpbusd, 3 rows x 16 columns), AVX2. Without VNNI
// 8-bit codes are split in two nibbles so vpmaddubsw's 16-bit pair sums cannot saturate (codes
// of 5 or 6 bits cannot).
// Work split: items of (a chunk of 64 rows, a group of panels) in chunk-major order, a
// contiguous range per thread of the calling thread's OpenMP team (torch's libgomp, shared by
// soname; one thread below kTeamWork multiply-adds). Each thread quantizes the chunks of its
// own range, so a call meets its team once (the region's end) and not at a barrier between
// quantizing and multiplying.
#include "cpu_common.h"
#include "cpu_kernels.h"

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

constexpr int kMaxRows = 4;
constexpr int kMaxColumns = 32;
constexpr int64_t kRowChunk = 64;
constexpr int64_t kTeamWork = int64_t{1} << 21;  // multiply-adds below which one thread works

// A chunk's quantized activation rows (row stride K): codes, d and d * sum(codes) per block of
// 32, d * sum(codes) per half block (two per block).
struct ChunkActivations {
  const int8_t* codes;
  const float* scales;
  const float* sums;
  const float* half_sums;
};

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

// ---- AVX-512 (with and without VNNI): 512-bit, two panels a tile -------------------------
#define QUANT_DOT_AVX512_COMMON                                                                  \
  constexpr int kWidth = 16, kRows = 4, kGroupPanels = 2;                                      \
  using VI = __m512i;                                                                          \
  using VF = __m512;                                                                           \
  inline VI zero() { return _mm512_setzero_si512(); }                                          \
  inline VF zerof() { return _mm512_setzero_ps(); }                                            \
  inline VI load(const uint8_t* p) { return _mm512_loadu_si512(p); }                          \
  inline VI low_nibbles(VI v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0f)); }          \
  inline VI high_nibbles(VI v) {                                                               \
    return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f));                  \
  }                                                                                            \
  inline VI broadcast4(const int8_t* p) { return _mm512_set1_epi32(load4(p)); }                \
  inline VF to_float(VI v) { return _mm512_cvtepi32_ps(v); }                                   \
  inline VF loadf(const float* p) { return _mm512_loadu_ps(p); }                               \
  inline VF set1f(float v) { return _mm512_set1_ps(v); }                                       \
  inline VF fmadd(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }                       \
  inline VF mul(VF a, VF b) { return _mm512_mul_ps(a, b); }                                    \
  inline void storef(float* p, VF v) { _mm512_storeu_ps(p, v); }

// ---- AVX-512 VNNI -------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vnni")
namespace isa_avx512_vnni {
namespace {
QUANT_DOT_AVX512_COMMON
inline VI dot4(VI acc, VI w, VI a) { return _mm512_dpbusd_epi32(acc, w, a); }
inline VI dot8(VI acc, VI w, VI a) { return _mm512_dpbusd_epi32(acc, w, a); }
#include "quant_dot_tile.inc"
}  // namespace
}  // namespace isa_avx512_vnni
#pragma GCC pop_options

// ---- AVX-512 BW ---------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw")
namespace isa_avx512_bw {
namespace {
QUANT_DOT_AVX512_COMMON
inline VI dot4(VI acc, VI w, VI a) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, a), _mm512_set1_epi16(1)));
}
inline VI dot8(VI acc, VI w, VI a) {
  const VI low = _mm512_madd_epi16(_mm512_maddubs_epi16(low_nibbles(w), a), _mm512_set1_epi16(1));
  const VI high =
      _mm512_madd_epi16(_mm512_maddubs_epi16(high_nibbles(w), a), _mm512_set1_epi16(16));
  return _mm512_add_epi32(acc, _mm512_add_epi32(low, high));
}
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

// One row-block of 32 float32 values quantized (see the file comment); returns sum(a) and the
// sums of its two halves.
inline int32_t quantize_block(const float* x, int8_t* codes, float* scale, int32_t halves[2]) {
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
  for (int i = 0; i < 4; ++i)  // cvtps rounds to nearest even (the default MXCSR mode)
    q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inverse)));
  const __m256i words = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                           _mm256_packs_epi32(q[2], q[3]));
  const __m256i ordered =
      _mm256_permutevar8x32_epi32(words, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes), ordered);
  for (int h = 0; h < 2; ++h) {
    const __m256i sum = _mm256_add_epi32(q[2 * h], q[2 * h + 1]);
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    halves[h] = _mm_cvtsi128_si32(s);
  }
  return halves[0] + halves[1];
}

// Rows [0, M) of x (float32, or bfloat16 when x_bf16) quantized by the calling thread alone:
// codes [M, K], dx and sx [M, K / 32], half_sums [M, K / 32, 2] (d times each half's code sum;
// null: not wanted).
void quantize_rows(const void* x, bool x_bf16, int64_t M, int64_t K, int8_t* codes, float* dx,
                   float* sx, float* half_sums) {
  const int64_t blocks = K / 32;
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
      int32_t halves[2];
      const int32_t total = quantize_block(block, codes + r * K + b * 32, &dx[index], halves);
      sx[index] = dx[index] * static_cast<float>(total);
      if (half_sums != nullptr) {
        half_sums[2 * index] = dx[index] * static_cast<float>(halves[0]);
        half_sums[2 * index + 1] = dx[index] * static_cast<float>(halves[1]);
      }
    }
  }
}

// One thread's quantized activations for a chunk of up to kRowChunk rows, reused across calls
// (an OpenMP team's threads live as long as the process).
struct ChunkScratch {
  std::vector<int8_t> codes;
  std::vector<float> scales, sums, half_sums;

  ChunkActivations quantize(const void* x, bool x_bf16, int64_t rows, int64_t K) {
    const size_t blocks = static_cast<size_t>(rows * (K / 32));
    codes.resize(static_cast<size_t>(rows * K));
    scales.resize(blocks);
    sums.resize(blocks);
    half_sums.resize(2 * blocks);
    quantize_rows(x, x_bf16, rows, K, codes.data(), scales.data(), sums.data(),
                  half_sums.data());
    return {codes.data(), scales.data(), sums.data(), half_sums.data()};
  }
};

using Multiply = void (*)(const ChunkActivations&, int64_t, int64_t, const uint8_t*, int,
                          const float*, const float*, int64_t, int64_t, int64_t, void*, bool);

struct Kernel {
  int columns;  // output columns per panel group
  Multiply multiply;
};

Kernel kernel_of(int isa) {
  switch (isa) {
    case kAvx512Vnni: return {isa_avx512_vnni::kColumns, isa_avx512_vnni::multiply};
    case kAvx512Bw: return {isa_avx512_bw::kColumns, isa_avx512_bw::multiply};
    case kAvxVnni: return {isa_avx_vnni::kColumns, isa_avx_vnni::multiply};
    default: return {isa_avx2::kColumns, isa_avx2::multiply};
  }
}

// The work of one thread of `threads`: the items [begin, end) of (row chunk, panel group) in
// chunk-major order. Each chunk the range touches is quantized by this thread into its own
// scratch (a chunk shared with a neighbour is quantized by both, the same bits), so the team
// meets only once, when the region ends.
void multiply_share(const Kernel& kernel, const void* x, bool x_bf16, int64_t M, int64_t K,
                    const uint8_t* codes, int bits, const float* scales, const float* mins,
                    int64_t N, void* out, bool out_bf16, int64_t thread, int64_t threads) {
  static thread_local ChunkScratch scratch;
  const int64_t groups = (N + kernel.columns - 1) / kernel.columns;
  const int64_t items = groups * ((M + kRowChunk - 1) / kRowChunk);
  const int64_t begin = items * thread / threads, end = items * (thread + 1) / threads;
  const size_t element = x_bf16 ? 2 : 4, out_element = out_bf16 ? 2 : 4;
  for (int64_t item = begin; item < end;) {
    const int64_t chunk = item / groups, group = item % groups;
    const int64_t group_end = group + (end - item) < groups ? group + (end - item) : groups;
    const int64_t row0 = chunk * kRowChunk;
    const int64_t rows = M - row0 < kRowChunk ? M - row0 : kRowChunk;
    const ChunkActivations act = scratch.quantize(
        static_cast<const char*>(x) + row0 * K * element, x_bf16, rows, K);
    kernel.multiply(act, rows, K, codes, bits, scales, mins, N, group, group_end,
                    static_cast<char*>(out) + row0 * N * out_element, out_bf16);
    item += group_end - group;
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
  quantize_rows(x, x_bf16 != 0, M, K, codes, dx, sx, nullptr);
  return 0;
}

// out[M, N] (float32, or bfloat16 when out_bf16) = x[M, K] . W^T with x quantized per
// row-block and W in the panel layout (see the file comment) of `bits`-bit codes (4, 5, 6 or
// 8), multiplied with instruction set `isa`. Returns 0, -1 for bad sizes or bits, -2 where the
// CPU lacks `isa`.
int quant_dot_matmul(int isa, const void* x, int x_bf16, int64_t M, int64_t K,
                     const uint8_t* weight_codes, int bits, const float* scales,
                     const float* mins, int64_t N, void* out, int out_bf16) {
  if (K <= 0 || K % 32 != 0 || M < 0 || N < 0) return -1;
  if (bits != 4 && bits != 5 && bits != 6 && bits != 8) return -1;
  if (!isa_supported(isa)) return -2;
  const Kernel kernel = kernel_of(isa);
  const bool team = M * N * K >= kTeamWork;
#pragma omp parallel if (team)
  {
#ifdef _OPENMP
    const int64_t thread = omp_get_thread_num(), threads = omp_get_num_threads();
#else
    const int64_t thread = 0, threads = 1;
#endif
    multiply_share(kernel, x, x_bf16 != 0, M, K, weight_codes, bits, scales, mins, N, out,
                   out_bf16 != 0, thread, threads);
  }
  return 0;
}

}  // extern "C"
