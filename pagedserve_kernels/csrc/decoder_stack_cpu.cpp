// A decode step's whole decoder stack in one call: for every layer, the residual add and RMS
// norm, the fused QKV product, rotary embeddings and the KV write, paged decode attention, the
// output projection, the second add and norm, the gate/up product, silu * up and the down
// product; then the final add and norm. One call replaces ~20 Python-level calls per layer
// (~600 a step for a 30-layer model), which cost as much as the arithmetic at small batches.
//
// It chains the kernels of q4_cpu.cpp, quant_dot_cpu.cpp, layer_ops_cpu.cpp and attention_cpu.cpp
// (linked into this library, see setup.py) in the order and with the roundings the model's
// per-operator path uses (workers/model.py with NativeCpuLayerOps and DenseMatmul), so both give
// the same bits for the same rows. Each linear layer goes through the kernel its table row names,
// whatever the row count: the exact 4-bit kernel (bits 0), or int8-quantized activations against
// panel codes of 4, 5, 6 or 8 bits (quant_dot_matmul, what the per-operator path runs with
// quantized activations). Each row's result does not depend on the other rows of the batch.
//
// Built by pip at install time (setup.py), loaded by pagedserve_kernels/decoder_stack_cpu.py via ctypes.
#include "cpu_common.h"
#include "cpu_kernels.h"

#include <stdint.h>
#include <stdlib.h>

#include <algorithm>

namespace {

// The addresses one layer contributes (a row of the caller's int64 layer table), in order.
enum Field : int64_t {
  kInputNorm,
  kQkvCodes,
  kQkvScales,
  kQkvMins,
  kOutCodes,
  kOutScales,
  kOutMins,
  kPostNorm,
  kGateUpCodes,
  kGateUpScales,
  kGateUpMins,
  kDownCodes,
  kDownScales,
  kDownMins,
  kWindow,  // the layer's sliding window in tokens (not an address); 0 for none
  kQkvBits,  // per product: 0 for the exact 4-bit layout (q4_matmul), else the panel codes' bits
  kOutBits,
  kGateUpBits,
  kDownBits,
  kFieldCount,
};

template <typename T>
const T* address(const int64_t* layer, Field field) {
  return reinterpret_cast<const T*>(layer[field]);
}

// out [rows, N] = x [rows, K] W^T for the layer's product whose codes start at field `codes`
// (then its scales and minimums) and whose bits are at field `bits` (see Field).
int product(int isa, int quant_isa, const int64_t* layer, Field codes, Field bits, const void* x,
            int bf16, float* widened, int64_t rows, int64_t K, int64_t N, void* out) {
  const uint8_t* weight = address<uint8_t>(layer, codes);
  const float* scales = address<float>(layer, static_cast<Field>(codes + 1));
  const float* mins = address<float>(layer, static_cast<Field>(codes + 2));
  const int64_t code_bits = layer[bits];
  if (code_bits == 0)
    return q4_matmul(isa, x, bf16, widened, rows, K, weight, scales, mins, N, out, bf16);
  return quant_dot_matmul(quant_isa, x, bf16, rows, K, weight, static_cast<int>(code_bits),
                          scales, mins, N, out, bf16);
}

// A 64-byte aligned scratch buffer, as torch allocates: the kernels' 64-byte vector loads of a
// misaligned row would each touch two cache lines (measured: 30-50 % slower at 6-8 rows).
class Buffer {
 public:
  explicit Buffer(size_t bytes)
      : data_(static_cast<char*>(aligned_alloc(kAlignment, round_up(bytes)))) {}
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { free(data_); }
  char* data() const { return data_; }
  bool ok() const { return data_ != nullptr; }

 private:
  static constexpr size_t kAlignment = 64;
  static size_t round_up(size_t bytes) {
    return (bytes + kAlignment - 1) / kAlignment * kAlignment + kAlignment;
  }
  char* data_;
};

// Scratch for one call; every buffer in the activations' dtype except `widened` (float32).
struct Workspace {
  Workspace(int64_t rows, int64_t hidden, int64_t qkv_width, int64_t q_width,
            int64_t intermediate, size_t element)
      : normed(rows * hidden * element),
        qkv(rows * qkv_width * element),
        queries(rows * q_width * element),
        attended(rows * q_width * element),
        projected(rows * hidden * element),
        gate_up(rows * 2 * intermediate * element),
        activated(rows * intermediate * element),
        delta(rows * hidden * element),
        widened(rows * std::max({hidden, q_width, intermediate}) * sizeof(float)) {}
  bool ok() const {
    return normed.ok() && qkv.ok() && queries.ok() && attended.ok() && projected.ok() &&
           gate_up.ok() && activated.ok() && delta.ok() && widened.ok();
  }
  Buffer normed, qkv, queries, attended, projected, gate_up, activated, delta, widened;
};

}  // namespace

extern "C" {

// 1 when this CPU runs decoder_stack with instruction set `isa` (cpu_common::Isa), else 0.
int decoder_stack_isa_supported(int isa) { return cpu_common::isa_supported(isa) ? 1 : 0; }

// 1 when this CPU runs decoder_stack with some instruction set (AVX2 and FMA at least), else 0.
int decoder_stack_supported(void) { return decoder_stack_isa_supported(cpu_common::kAvx2); }

// The width of a row of the layer table.
int64_t decoder_stack_fields(void) { return kFieldCount; }

// Runs `num_layers` pre-norm decoder layers over `rows` decodes, one token each, every kernel
// with instruction set `isa` (cpu_common::Isa) but the int8 products, which run with
// `quant_isa` (quant_dot_isa_supported's numbering; read only where a product has bits).
//
// residual [rows, hidden] float32 is the stream after the embedding; it is updated in place and
// `out` [rows, hidden] float32 receives final_norm(residual + last MLP output). layers is
// [num_layers, decoder_stack_fields()] int64 (see Field): norm weights [hidden] and weights as
// q4_matmul (bits 0) or quant_dot_matmul (bits 4, 5, 6, 8) takes them (qkv
// [(num_q + 2 num_kv) head_dim, hidden], out [hidden, num_q head_dim], gate_up
// [2 intermediate, hidden], down [hidden, intermediate]),
// norm weights and activations bfloat16 when bf16, else float32; final_norm float32.
// cos / sin [rows, head_dim] float32; slots [rows] int64 (the token's KV slot, -1: none).
// Layer l's key cache starts layer_bytes * l bytes into kv_pool and its value cache
// value_offset bytes after that, each [blocks, block_size, num_kv, head_dim] contiguous.
// Decode r is token row seq_rows[r] (the identity here), attending over context_lens[r] keys
// through block_tables row r (table_stride apart), this step's key included.
// The caller validates shapes, ids and lengths. Returns 0, or the first failing kernel's
// status (-1 for unsupported geometry, -2 where the CPU lacks `isa`), -3 when out of memory.
int decoder_stack(int isa, int quant_isa, const int64_t* layers, int64_t num_layers, int bf16,
                  int64_t hidden, int64_t num_q, int64_t num_kv, int64_t head_dim,
                  int64_t intermediate,
                  float eps, float scale, float* residual, int64_t rows, const float* cos,
                  const float* sin, const int64_t* slots, char* kv_pool, int64_t layer_bytes,
                  int64_t value_offset, const int64_t* seq_rows, const int32_t* context_lens,
                  const int32_t* block_tables, int64_t table_stride, int64_t block_size,
                  const float* final_norm, float* out) {
  if (!cpu_common::isa_supported(isa)) return -2;
  if (rows <= 0 || num_kv <= 0 || num_q % num_kv != 0) return -1;
  const int64_t q_width = num_q * head_dim;
  const int64_t qkv_width = (num_q + 2 * num_kv) * head_dim;
  Workspace w(rows, hidden, qkv_width, q_width, intermediate, bf16 ? 2 : 4);
  if (!w.ok()) return -3;
  float* widened = reinterpret_cast<float*>(w.widened.data());
  const void* pending = nullptr;  // the previous layer's MLP output, not yet in the residual
  for (int64_t l = 0; l < num_layers; ++l) {
    const int64_t* layer = layers + l * kFieldCount;
    char* k_cache = kv_pool + l * layer_bytes;
    char* v_cache = k_cache + value_offset;
    int status = add_rms_norm(isa, residual, pending, bf16, address<void>(layer, kInputNorm),
                              bf16, eps, rows, hidden, w.normed.data(), bf16);
    if (status == 0)
      status = product(isa, quant_isa, layer, kQkvCodes, kQkvBits, w.normed.data(), bf16,
                       widened, rows, hidden, qkv_width, w.qkv.data());
    if (status == 0)
      status = rotary_write_kv(isa, w.qkv.data(), qkv_width, bf16, rows, num_q, num_kv,
                               head_dim, cos, sin, slots, k_cache, v_cache, w.queries.data());
    if (status == 0)
      status = decode_attention(isa, w.queries.data(), q_width, head_dim, k_cache, v_cache,
                                bf16, 0, seq_rows, context_lens, block_tables, table_stride, rows,
                                num_kv, num_q / num_kv, head_dim, block_size, scale,
                                layer[kWindow], w.attended.data(), q_width, head_dim);
    if (status == 0)
      status = product(isa, quant_isa, layer, kOutCodes, kOutBits, w.attended.data(), bf16,
                       widened, rows, q_width, hidden, w.projected.data());
    if (status == 0)
      status = add_rms_norm(isa, residual, w.projected.data(), bf16,
                            address<void>(layer, kPostNorm), bf16, eps, rows, hidden,
                            w.normed.data(), bf16);
    if (status == 0)
      status = product(isa, quant_isa, layer, kGateUpCodes, kGateUpBits, w.normed.data(), bf16,
                       widened, rows, hidden, 2 * intermediate, w.gate_up.data());
    if (status == 0)
      status = silu_mul(isa, w.gate_up.data(), bf16, rows, intermediate, w.activated.data());
    if (status == 0)
      status = product(isa, quant_isa, layer, kDownCodes, kDownBits, w.activated.data(), bf16,
                       widened, rows, intermediate, hidden, w.delta.data());
    if (status != 0) return status;
    pending = w.delta.data();
  }
  return add_rms_norm(isa, residual, pending, bf16, final_norm, 0, eps, rows, hidden, out, 0);
}

}  // extern "C"
