// y = x W^T for W stored as 4-bit codes with a float32 scale and minimum per block of 32 weights
// of a row (GGUF's Q4_1 layout: w = scale * q + min, q in 0..15), on x86-64 with AVX-512.
//
// Built by pip at install time (setup.py) as a plain shared library with a C ABI, loaded by
// kernels/q4_cpu.py through ctypes after torch.
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
// torch uses from that thread). Rows go in tiles of up to 8 (up to 4 against a whole strip, 5-8
// against two of its columns at a time, so the accumulators stay in registers): the weights are
// dequantized in registers for every tile, which suits the decode batches it is meant for;
// larger batches belong to a dense kernel.
#include "cpu_common.h"
#include "cpu_kernels.h"

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

namespace {

using cpu_common::bf16_to_float;
using cpu_common::float_to_bf16;

constexpr int kBlock = 32;
constexpr int kStrip = 4;
constexpr int kTileRows = 8;
constexpr int kNarrowRows = 4;  // tiles of up to this many rows take a whole strip at once

#define Q4_TARGET __attribute__((target("avx512f,avx512bw")))

// sums[r][c] = x[r] . w[c] for ROWS rows of x (row stride K) and COLS weight rows.
template <int ROWS, int COLS>
Q4_TARGET void tile(const float* x, int64_t K, const uint8_t* codes, const float* scales,
                    const float* mins, float sums[kTileRows][kStrip], int c0) {
  const int64_t blocks = K / kBlock;
  const __m512i low_nibble = _mm512_set1_epi32(0x0f);
  __m512 acc[ROWS][COLS];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < COLS; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 low_x[ROWS], high_x[ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      low_x[r] = _mm512_loadu_ps(x + r * K + b * kBlock);
      high_x[r] = _mm512_loadu_ps(x + r * K + b * kBlock + 16);
    }
#pragma GCC unroll 8
    for (int c = 0; c < COLS; ++c) {
      // byte j of a block holds code j (low nibble) and code j + 16 (high nibble)
      const __m128i bytes =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + c * (K / 2) + b * 16));
      const __m512i wide = _mm512_cvtepu8_epi32(bytes);
      const __m512 scale = _mm512_set1_ps(scales[c * blocks + b]);
      const __m512 minimum = _mm512_set1_ps(mins[c * blocks + b]);
      const __m512 low = _mm512_fmadd_ps(
          _mm512_cvtepi32_ps(_mm512_and_si512(wide, low_nibble)), scale, minimum);
      const __m512 high =
          _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(wide, 4)), scale, minimum);
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        acc[r][c] = _mm512_fmadd_ps(low, low_x[r], acc[r][c]);
        acc[r][c] = _mm512_fmadd_ps(high, high_x[r], acc[r][c]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < COLS; ++c) sums[r][c0 + c] = _mm512_reduce_add_ps(acc[r][c]);
}

// A tile of up to 4 rows (`rows`) against COLS weight rows (a whole strip).
template <int COLS>
Q4_TARGET void narrow_tile(int rows, const float* x, int64_t K, const uint8_t* codes,
                           const float* scales, const float* mins,
                           float sums[kTileRows][kStrip]) {
  switch (rows) {
    case 4: tile<4, COLS>(x, K, codes, scales, mins, sums, 0); break;
    case 3: tile<3, COLS>(x, K, codes, scales, mins, sums, 0); break;
    case 2: tile<2, COLS>(x, K, codes, scales, mins, sums, 0); break;
    default: tile<1, COLS>(x, K, codes, scales, mins, sums, 0); break;
  }
}

// A tile of 5-8 rows against COLS (1 or 2) weight rows starting at column c0 of the strip:
// fewer columns at once keep the ROWS * COLS accumulators in registers, and each dequantized
// weight serves up to 8 rows.
template <int COLS>
Q4_TARGET void wide_tile(int rows, const float* x, int64_t K, const uint8_t* codes,
                         const float* scales, const float* mins, float sums[kTileRows][kStrip],
                         int c0) {
  switch (rows) {
    case 8: tile<8, COLS>(x, K, codes, scales, mins, sums, c0); break;
    case 7: tile<7, COLS>(x, K, codes, scales, mins, sums, c0); break;
    case 6: tile<6, COLS>(x, K, codes, scales, mins, sums, c0); break;
    default: tile<5, COLS>(x, K, codes, scales, mins, sums, c0); break;
  }
}

Q4_TARGET void strip_product(const float* x, int64_t M, int64_t K, int64_t N, int64_t n0,
                             int columns, const uint8_t* codes, const float* scales,
                             const float* mins, void* out, bool out_bf16) {
  const int64_t blocks = K / kBlock;
  codes += n0 * (K / 2);
  scales += n0 * blocks;
  mins += n0 * blocks;
  float sums[kTileRows][kStrip];
  for (int64_t r0 = 0; r0 < M; r0 += kTileRows) {
    const int rows = static_cast<int>(M - r0 < kTileRows ? M - r0 : kTileRows);
    const float* x_tile = x + r0 * K;
    if (rows <= kNarrowRows) {
      switch (columns) {
        case 4: narrow_tile<4>(rows, x_tile, K, codes, scales, mins, sums); break;
        case 3: narrow_tile<3>(rows, x_tile, K, codes, scales, mins, sums); break;
        case 2: narrow_tile<2>(rows, x_tile, K, codes, scales, mins, sums); break;
        default: narrow_tile<1>(rows, x_tile, K, codes, scales, mins, sums); break;
      }
    } else {
      for (int c0 = 0; c0 < columns; c0 += 2) {
        const uint8_t* pair_codes = codes + c0 * (K / 2);
        const float* pair_scales = scales + c0 * blocks;
        const float* pair_mins = mins + c0 * blocks;
        if (columns - c0 >= 2)
          wide_tile<2>(rows, x_tile, K, pair_codes, pair_scales, pair_mins, sums, c0);
        else
          wide_tile<1>(rows, x_tile, K, pair_codes, pair_scales, pair_mins, sums, c0);
      }
    }
    for (int r = 0; r < rows; ++r) {
      const int64_t offset = (r0 + r) * N + n0;
      for (int c = 0; c < columns; ++c) {
        if (out_bf16)
          static_cast<uint16_t*>(out)[offset + c] = float_to_bf16(sums[r][c]);
        else
          static_cast<float*>(out)[offset + c] = sums[r][c];
      }
    }
  }
}

}  // namespace

extern "C" {

// 1 when this CPU runs q4_matmul (AVX-512 F and BW), else 0.
int q4_supported(void) { return cpu_common::avx512_supported(); }

// out[M, N] = x[M, K] . W[N, K]^T, W given as codes [N, K / 2] (uint8), scales and mins
// [N, K / 32] (float32); every buffer contiguous. x is float32, or bfloat16 when x_bf16, in which
// case `widened` must hold M * K float32 (scratch). Returns 0, or -1 for a K that is not a
// positive multiple of 32, -2 where the CPU lacks AVX-512.
int q4_matmul(const void* x, int x_bf16, float* widened, int64_t M, int64_t K,
              const uint8_t* codes, const float* scales, const float* mins, int64_t N, void* out,
              int out_bf16) {
  if (K <= 0 || K % kBlock != 0 || M < 0 || N < 0) return -1;
  if (!q4_supported()) return -2;
  const float* x_f32 = static_cast<const float*>(x);
  if (x_bf16) {
    const uint16_t* source = static_cast<const uint16_t*>(x);
    for (int64_t i = 0; i < M * K; ++i) widened[i] = bf16_to_float(source[i]);
    x_f32 = widened;
  }
  const int64_t strips = (N + kStrip - 1) / kStrip;
#pragma omp parallel for schedule(static)
  for (int64_t s = 0; s < strips; ++s) {
    const int64_t n0 = s * kStrip;
    const int columns = static_cast<int>(N - n0 < kStrip ? N - n0 : kStrip);
    strip_product(x_f32, M, K, N, n0, columns, codes, scales, mins, out, out_bf16 != 0);
  }
  return 0;
}

}  // extern "C"
