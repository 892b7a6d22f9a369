// y = x W^T for W stored as 8-bit codes with a float32 scale per block of 32 weights of a row
// (GGUF's Q8_0 layout: w = scale * q, q in -128..127), on x86-64 with AVX-512. Meant for an LM
// head whose checkpoint is Q8_0 (the default model's tied embedding): a decode step's few rows
// against a wide vocabulary.
//
// Built by pip at install time (setup.py) as a plain shared library with a C ABI, loaded by
// kernels/q8_cpu.py through ctypes after torch.
//
// Exactness: Q8_0 scales are float16 values, so scale * q (an 11-bit significand times an 8-bit
// integer) is exact in float32: each weight used is bit-identical to the dequantized float32
// weight, and the product equals a float32 matmul over them up to the order of float32
// summation. x and the result are float32.
//
// Work split: output columns in strips of 4 spread over the calling thread's OpenMP team (torch's
// libgomp, shared by soname); rows in tiles of up to 4 against a whole strip, the weights
// dequantized in registers once per tile.
#include "cpu_common.h"
#include "cpu_kernels.h"

#include <immintrin.h>
#include <stdint.h>

namespace {

constexpr int kBlock = 32;
constexpr int kStrip = 4;
constexpr int kTileRows = 4;

#define Q8_TARGET __attribute__((target("avx512f,avx512bw")))

// out[r][c] = x[r] . w[c] for ROWS rows of x (row stride K) and COLS weight rows.
template <int ROWS, int COLS>
Q8_TARGET void tile(const float* x, int64_t K, const int8_t* codes, const float* scales,
                    float* out, int64_t N) {
  const int64_t blocks = K / kBlock;
  __m512 acc[ROWS][COLS];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 low_x[ROWS], high_x[ROWS];
    for (int r = 0; r < ROWS; ++r) {
      low_x[r] = _mm512_loadu_ps(x + r * K + b * kBlock);
      high_x[r] = _mm512_loadu_ps(x + r * K + b * kBlock + 16);
    }
    for (int c = 0; c < COLS; ++c) {
      const int8_t* block = codes + c * K + b * kBlock;
      const __m512 scale = _mm512_set1_ps(scales[c * blocks + b]);
      const __m512 low = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(block)))),
          scale);
      const __m512 high = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16)))),
          scale);
      for (int r = 0; r < ROWS; ++r) {
        acc[r][c] = _mm512_fmadd_ps(low, low_x[r], acc[r][c]);
        acc[r][c] = _mm512_fmadd_ps(high, high_x[r], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) out[r * N + c] = _mm512_reduce_add_ps(acc[r][c]);
}

template <int COLS>
Q8_TARGET void rows_tile(int rows, const float* x, int64_t K, const int8_t* codes,
                         const float* scales, float* out, int64_t N) {
  switch (rows) {
    case 4: tile<4, COLS>(x, K, codes, scales, out, N); break;
    case 3: tile<3, COLS>(x, K, codes, scales, out, N); break;
    case 2: tile<2, COLS>(x, K, codes, scales, out, N); break;
    default: tile<1, COLS>(x, K, codes, scales, out, N); break;
  }
}

Q8_TARGET void strip_product(const float* x, int64_t M, int64_t K, int64_t N, int64_t n0,
                             int columns, const int8_t* codes, const float* scales, float* out) {
  codes += n0 * K;
  scales += n0 * (K / kBlock);
  for (int64_t r0 = 0; r0 < M; r0 += kTileRows) {
    const int rows = static_cast<int>(M - r0 < kTileRows ? M - r0 : kTileRows);
    const float* x_tile = x + r0 * K;
    float* out_tile = out + r0 * N + n0;
    switch (columns) {
      case 4: rows_tile<4>(rows, x_tile, K, codes, scales, out_tile, N); break;
      case 3: rows_tile<3>(rows, x_tile, K, codes, scales, out_tile, N); break;
      case 2: rows_tile<2>(rows, x_tile, K, codes, scales, out_tile, N); break;
      default: rows_tile<1>(rows, x_tile, K, codes, scales, out_tile, N); break;
    }
  }
}

}  // namespace

extern "C" {

// 1 when this CPU runs q8_matmul (AVX-512 F and BW), else 0.
int q8_supported(void) { return cpu_common::avx512_supported(); }

// out[M, N] = x[M, K] . W[N, K]^T, W given as codes [N, K] (int8) and scales [N, K / 32]
// (float32); x and out float32; every buffer contiguous. Returns 0, or -1 for a K that is not a
// positive multiple of 32, -2 where the CPU lacks AVX-512.
int q8_matmul(const float* x, int64_t M, int64_t K, const int8_t* codes, const float* scales,
              int64_t N, float* out) {
  if (K <= 0 || K % kBlock != 0 || M < 0 || N < 0) return -1;
  if (!q8_supported()) return -2;
  const int64_t strips = (N + kStrip - 1) / kStrip;
#pragma omp parallel for schedule(static)
  for (int64_t s = 0; s < strips; ++s) {
    const int64_t n0 = s * kStrip;
    const int columns = static_cast<int>(N - n0 < kStrip ? N - n0 : kStrip);
    strip_product(x, M, K, N, n0, columns, codes, scales, out);
  }
  return 0;
}

}  // extern "C"
