// Paged decode attention on x86-64 with AVX2 and FMA or AVX-512: one query token per row (a
// decode, or one position of a prefill chunk attending as a decode of that position), its keys
// and values read in place from the block table (no gather into a padded buffer, no mask).
//
// Built by pip at install time (setup.py) as a plain shared library with a C ABI, loaded by
// pagedserve_kernels/attention_cpu.py through ctypes after torch. Compiled for generic x86-64:
// the body (attention_body.inc, over vec16.inc's Vec16) is compiled once per instruction set in
// its own `#pragma GCC target` region, and the caller names the set
// (`decode_attention_isa_supported`). Both add in the orders below, so they give the same bits
// wherever the compiler's 512-bit lane sum (reduce_add, the softmax total) halves as the AVX2
// one does, as GCC's does.
//
// Int8 caches (pagedserve_kernels/kv_quant.py) are read in place: each (token, KV head) vector is
// head_dim int8 codes and then its bfloat16 scale; the codes are widened to float32 in registers,
// a key's products with the query are scaled by its scale (with the softmax scale), and a value's
// softmax weight is multiplied by its scale after the weights' sum is taken. No float copy of the
// cache is made.
//
// Numerics: everything after the loads is float32. Keys and values (float32 or bfloat16, widened
// exactly) are multiplied with the float32 query, the scores scaled, the softmax taken in float32
// (max subtracted, a vector exp within a few ulp of expf), the values summed with float32 weights
// and the result scaled once by the reciprocal of the weights' sum, then stored in the query's
// dtype (bfloat16 rounded to nearest even, as torch rounds). That is the computation of
// pagedserve_kernels.reference up to float32 summation order and the exp's last bits. The orders:
//   score of head h, key t: lane i (of 16) is the fused multiply-add chain q[c] * k_t[c] + ...
//     over the columns c = i mod 16 in increasing order, from zero; the 16 lanes are then added
//     as a halving tree (lane i + lane i + 8, of those i + i + 4, then i + i + 2, then i + i + 1:
//     reduce_add's order, taken for 16 keys at once by vec16.inc's folds), and scaled.
//   softmax total: lane i sums the numerators of the keys t = i mod 16 in key order, then the
//     same tree; its reciprocal is taken once.
//   output column c: the fused multiply-add chain p_t * v_t[c] + ... over the keys in order,
//     from zero, times that reciprocal.
//
// Work split: one item per sequence (every KV head, reading each key and value row once for all
// the sequence's query heads), or per (sequence, KV head) when there are fewer sequences than
// twice the threads, so one long decode still uses the team. Items are handed out one at a time
// to the calling thread's OpenMP team (the libgomp.so.1 torch loaded, shared by soname) as its
// threads come free: rows differ in length (a prefill chunk's query rows, each a decode of its own
// position, grow by one key per row), and a thread the OS deschedules for a while leaves its share
// to the others instead of holding every thread at the region's end. Which thread takes an item
// never changes its bits. A call that reads fewer keys than it takes to wake a team runs on the
// calling thread alone.
#include "cpu_common.h"
#include "cpu_kernels.h"

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <omp.h>

#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxGroup = 16;
constexpr int64_t kSerialKeyRows = 256;  // below this many (key, KV head) rows: no team
constexpr int64_t kScaleBytes = 2;  // an int8 cache's bfloat16 scale after each vector's codes

struct Geometry {
  int64_t num_kv_heads, group, head_dim, block_size;
  int64_t query_row_stride, query_head_stride, out_row_stride, out_head_stride;
  float scale;
  int64_t window;  // 0: none
};

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw")
namespace isa_avx512 {
namespace {
#define VEC16_AVX512 1
#include "vec16.inc"
#undef VEC16_AVX512
#include "attention_body.inc"
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
#include "attention_body.inc"
}  // namespace
}  // namespace isa_avx2
#pragma GCC pop_options

extern "C" {

// 1 when this CPU runs decode_attention with instruction set `isa` (cpu_common::Isa), else 0.
int decode_attention_isa_supported(int isa) { return cpu_common::isa_supported(isa) ? 1 : 0; }

// 1 when this CPU runs decode_attention with some instruction set (AVX2 and FMA at least).
int decode_attention_supported(void) { return decode_attention_isa_supported(cpu_common::kAvx2); }

// For each sequence s: query row rows[s] (H_q = num_kv_heads * group heads of head_dim, strides
// in elements, the last dimension contiguous) attends over its context_lens[s] keys (the last
// `window` of them when window > 0), read from k_cache / v_cache
// [num_blocks, block_size, num_kv_heads, head_dim] (contiguous) through block_tables row s
// (int32, table_stride apart); the result goes to the same row of `out`. query and out share one
// dtype: float32 (bf16 = 0) or bfloat16 (bf16 = 1); the caches have it too, or (kv_int8 = 1)
// hold int8 codes, [..., head_dim + kScaleBytes] per KV head. The caller validates ids and
// lengths. Returns 0; -1 for a head_dim that is not a multiple of 16 up to 256 or a group over
// 16; -2 where the CPU lacks `isa`.
int decode_attention(int isa, const void* query, int64_t query_row_stride,
                     int64_t query_head_stride, const void* k_cache, const void* v_cache,
                     int bf16, int kv_int8, const int64_t* rows, const int32_t* context_lens,
                     const int32_t* block_tables, int64_t table_stride, int64_t num_seqs,
                     int64_t num_kv_heads, int64_t group,
                     int64_t head_dim, int64_t block_size, float scale, int64_t window,
                     void* out, int64_t out_row_stride, int64_t out_head_stride) {
  if (head_dim <= 0 || head_dim % kLanes != 0 || head_dim > kMaxHeadDim) return -1;
  if (group <= 0 || group > kMaxGroup || num_kv_heads <= 0 || block_size <= 0) return -1;
  if (!cpu_common::isa_supported(isa)) return -2;
  const Geometry g{num_kv_heads,     group,          head_dim,       block_size,
                   query_row_stride, query_head_stride, out_row_stride, out_head_stride,
                   scale,            window};
  using Attend = decltype(&isa_avx2::attend_all<false, false>);
  const Attend by_isa[2][2][2] = {
      {{isa_avx2::attend_all<false, false>, isa_avx2::attend_all<false, true>},
       {isa_avx2::attend_all<true, false>, isa_avx2::attend_all<true, true>}},
      {{isa_avx512::attend_all<false, false>, isa_avx512::attend_all<false, true>},
       {isa_avx512::attend_all<true, false>, isa_avx512::attend_all<true, true>}},
  };
  const Attend attend = by_isa[isa == cpu_common::kAvx512][bf16 ? 1 : 0][kv_int8 ? 1 : 0];
  attend(query, k_cache, v_cache, rows, context_lens, block_tables, table_stride, num_seqs, g,
         out);
  return 0;
}

}  // extern "C"
