// Paged decode attention on x86-64 with AVX-512: one query token per sequence, its keys and
// values read in place from the block table (no gather into a padded buffer, no mask).
//
// Built by pip at install time (setup.py) as a plain shared library with a C ABI, loaded by
// kernels/attention_cpu.py through ctypes after torch.
//
// Numerics: everything after the loads is float32. Keys and values (float32 or bfloat16, widened
// exactly) are multiplied with the float32 query, the scores scaled, the softmax taken in float32
// (max subtracted, a vector exp within a few ulp of expf), the values summed with float32 weights
// and the result scaled once by the reciprocal of the weights' sum, then stored in the query's
// dtype (bfloat16 rounded to nearest even, as torch rounds). That is the computation of
// kernels.reference up to float32 summation order and the exp's last bits.
//
// Work split: one item per sequence (every KV head, reading each key and value row once for all
// the sequence's query heads), or per (sequence, KV head) when there are fewer sequences than
// twice the threads, so one long decode still uses the team. Items are spread over the calling
// thread's OpenMP team (the libgomp.so.1 torch loaded, shared by soname), or run on the calling
// thread alone when the whole call reads fewer keys than it takes to wake a team.
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

using cpu_common::float_to_bf16;

constexpr int64_t kLanes = 16;
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxGroup = 16;
constexpr int64_t kSerialKeyRows = 256;  // below this many (key, KV head) rows: no team

#define ATTN_TARGET __attribute__((target("avx512f,avx512bw")))

// 16 values at `p` (float32, or bfloat16 widened exactly) as float32.
template <bool BF16>
ATTN_TARGET inline __m512 load16(const void* p) {
  if constexpr (BF16) {
    return cpu_common::load_bf16x16(static_cast<const uint16_t*>(p));
  } else {
    return _mm512_loadu_ps(p);
  }
}

// e^x for x <= 0 (softmax arguments); results below e^-87 flush to zero, as their weight does
// not register beside the maximum's 1.
ATTN_TARGET inline __m512 exp_nonpositive(__m512 x) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), cpu_common::exp_ps(x));
}

struct Geometry {
  int64_t num_kv_heads, group, head_dim, block_size;
  int64_t query_row_stride, query_head_stride, out_row_stride, out_head_stride;
  float scale;
  int64_t window;  // 0: none
};

// The row of key or value `position` of a sequence: every KV head's vector, contiguous.
template <typename Element>
inline const Element* token_row(const void* cache, const int32_t* table, int64_t position,
                                const Geometry& g) {
  const int64_t slot =
      static_cast<int64_t>(table[position / g.block_size]) * g.block_size + position % g.block_size;
  return static_cast<const Element*>(cache) + slot * g.num_kv_heads * g.head_dim;
}

// One sequence, KV heads [head_begin, head_end) and the `group` query heads of each, over its
// keys [first, context_len), reading each key and value row once for all those heads.
// `scratch` holds q * (keys + 2 * head_dim + 1) floats for the item's q query heads.
template <bool BF16>
ATTN_TARGET void attend_item(const void* query, const void* k_cache, const void* v_cache,
                             int64_t row, int64_t context_len, const int32_t* table,
                             int64_t head_begin, int64_t head_end, const Geometry& g,
                             float* scratch, void* out) {
  using Element = typename std::conditional<BF16, uint16_t, float>::type;
  const int64_t dim = g.head_dim, vectors = dim / kLanes;
  const int64_t first = g.window > 0 && context_len > g.window ? context_len - g.window : 0;
  const int64_t keys = context_len - first;
  const int64_t heads = (head_end - head_begin) * g.group;  // query heads of this item
  const int64_t q_head0 = head_begin * g.group;
  const Element* q = static_cast<const Element*>(query) + row * g.query_row_stride;
  float* scores = scratch;                   // [heads][keys]
  float* q_f32 = scratch + heads * keys;     // [heads][dim]
  float* mixed = q_f32 + heads * dim;        // [heads][dim]
  float* inverse = mixed + heads * dim;      // [heads]
  for (int64_t h = 0; h < heads; ++h) {
    const Element* head = q + (q_head0 + h) * g.query_head_stride;
    for (int64_t v = 0; v < vectors; ++v)
      _mm512_storeu_ps(q_f32 + h * dim + v * kLanes, load16<BF16>(head + v * kLanes));
  }

  // scores[h][t] = scale * q_h . k_t
  for (int64_t t = 0; t < keys; ++t) {
    const Element* k = token_row<Element>(k_cache, table, first + t, g) + head_begin * dim;
    for (int64_t kv = 0; kv < head_end - head_begin; ++kv) {
      const Element* kh = k + kv * dim;
      for (int64_t j = 0; j < g.group; ++j) {
        const int64_t h = kv * g.group + j;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t v = 0; v < vectors; ++v)
          acc = _mm512_fmadd_ps(_mm512_loadu_ps(q_f32 + h * dim + v * kLanes),
                                load16<BF16>(kh + v * kLanes), acc);
        scores[h * keys + t] = _mm512_reduce_add_ps(acc) * g.scale;
      }
    }
  }

  // softmax numerators in place, and the reciprocal of their sums
  for (int64_t h = 0; h < heads; ++h) {
    float* s = scores + h * keys;
    __m512 maxima = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + kLanes <= keys; t += kLanes) maxima = _mm512_max_ps(maxima, _mm512_loadu_ps(s + t));
    float maximum = _mm512_reduce_max_ps(maxima);
    for (; t < keys; ++t) maximum = s[t] > maximum ? s[t] : maximum;
    const __m512 shift = _mm512_set1_ps(maximum);
    __m512 total = _mm512_setzero_ps();
    for (t = 0; t < keys; t += kLanes) {
      const int64_t left = keys - t;
      const __mmask16 lanes = left >= kLanes ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
      const __m512 e =
          exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, s + t), shift));
      _mm512_mask_storeu_ps(s + t, lanes, e);
      total = _mm512_add_ps(total, _mm512_maskz_mov_ps(lanes, e));
    }
    inverse[h] = 1.0f / _mm512_reduce_add_ps(total);
  }

  // out_h = sum_t p[h][t] v_t / sum_t p[h][t]
  memset(mixed, 0, sizeof(float) * heads * dim);
  for (int64_t t = 0; t < keys; ++t) {
    const Element* val = token_row<Element>(v_cache, table, first + t, g) + head_begin * dim;
    for (int64_t kv = 0; kv < head_end - head_begin; ++kv) {
      for (int64_t v = 0; v < vectors; ++v) {
        const __m512 vv = load16<BF16>(val + kv * dim + v * kLanes);
        for (int64_t j = 0; j < g.group; ++j) {
          const int64_t h = kv * g.group + j;
          float* m = mixed + h * dim + v * kLanes;
          _mm512_storeu_ps(
              m, _mm512_fmadd_ps(_mm512_set1_ps(scores[h * keys + t]), vv, _mm512_loadu_ps(m)));
        }
      }
    }
  }
  Element* o = static_cast<Element*>(out) + row * g.out_row_stride;
  for (int64_t h = 0; h < heads; ++h) {
    Element* head = o + (q_head0 + h) * g.out_head_stride;
    for (int64_t d = 0; d < dim; ++d) {
      const float value = mixed[h * dim + d] * inverse[h];
      if constexpr (BF16) {
        head[d] = float_to_bf16(value);
      } else {
        head[d] = value;
      }
    }
  }
}

// Items: whole sequences (every KV head) when there are enough to share among the team, else
// (sequence, KV head) pairs so that one long decode still uses every thread.
template <bool BF16>
void attend_all(const void* query, const void* k_cache, const void* v_cache,
                const int64_t* rows, const int32_t* context_lens, const int32_t* block_tables,
                int64_t table_stride, int64_t num_seqs, const Geometry& g, void* out) {
  int64_t key_rows = 0;
  for (int64_t s = 0; s < num_seqs; ++s) key_rows += context_lens[s];
  key_rows *= g.num_kv_heads;
  const int threads = key_rows >= kSerialKeyRows ? omp_get_max_threads() : 1;
  const int64_t heads_per_item = num_seqs >= 2 * threads ? g.num_kv_heads : 1;
  const int64_t items_per_seq = g.num_kv_heads / heads_per_item;
  const int64_t items = num_seqs * items_per_seq;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scratch;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t seq = item / items_per_seq;
      const int64_t head_begin = (item % items_per_seq) * heads_per_item;
      const int64_t context_len = context_lens[seq];
      const size_t needed =
          static_cast<size_t>(heads_per_item * g.group * (context_len + 2 * g.head_dim + 1));
      if (scratch.size() < needed) scratch.resize(needed);
      attend_item<BF16>(query, k_cache, v_cache, rows[seq], context_len,
                        block_tables + seq * table_stride, head_begin,
                        head_begin + heads_per_item, g, scratch.data(), out);
    }
  }
}

}  // namespace

extern "C" {

// 1 when this CPU runs decode_attention (AVX-512 F and BW), else 0.
int decode_attention_supported(void) { return cpu_common::avx512_supported(); }

// For each sequence s: query row rows[s] (H_q = num_kv_heads * group heads of head_dim, strides
// in elements, the last dimension contiguous) attends over its context_lens[s] keys (the last
// `window` of them when window > 0), read from k_cache / v_cache
// [num_blocks, block_size, num_kv_heads, head_dim] (contiguous) through block_tables row s
// (int32, table_stride apart); the result goes to the same row of `out`. query, caches and out
// share one dtype: float32 (bf16 = 0) or bfloat16 (bf16 = 1). The caller validates ids and
// lengths. Returns 0; -1 for a head_dim that is not a multiple of 16 up to 256 or a group over
// 16; -2 where the CPU lacks AVX-512.
int decode_attention(const void* query, int64_t query_row_stride, int64_t query_head_stride,
                     const void* k_cache, const void* v_cache, int bf16, const int64_t* rows,
                     const int32_t* context_lens, const int32_t* block_tables,
                     int64_t table_stride, int64_t num_seqs, int64_t num_kv_heads, int64_t group,
                     int64_t head_dim, int64_t block_size, float scale, int64_t window,
                     void* out, int64_t out_row_stride, int64_t out_head_stride) {
  if (head_dim <= 0 || head_dim % kLanes != 0 || head_dim > kMaxHeadDim) return -1;
  if (group <= 0 || group > kMaxGroup || num_kv_heads <= 0 || block_size <= 0) return -1;
  if (!decode_attention_supported()) return -2;
  const Geometry g{num_kv_heads,     group,          head_dim,       block_size,
                   query_row_stride, query_head_stride, out_row_stride, out_head_stride,
                   scale,            window};
  if (bf16) {
    attend_all<true>(query, k_cache, v_cache, rows, context_lens, block_tables, table_stride,
                     num_seqs, g, out);
  } else {
    attend_all<false>(query, k_cache, v_cache, rows, context_lens, block_tables, table_stride,
                      num_seqs, g, out);
  }
  return 0;
}

}  // extern "C"
