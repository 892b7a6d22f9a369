// The C ABI of the native CPU kernels (q4_cpu.cpp, q8_cpu.cpp, quant_dot_cpu.cpp,
// attention_cpu.cpp, layer_ops_cpu.cpp); decoder_stack_cpu.cpp links and chains all but q8.
// Each kernel's source
// includes this header too, so a signature changed in one place and not the other fails to
// compile.
// Every function returns 0, or a negative status (see its definition). `isa` is the instruction
// set to run (cpu_common::Isa; quant_dot's own numbering for quant_dot_*); `*_isa_supported(isa)`
// says whether this CPU has it.
#pragma once

#include <stdint.h>

extern "C" {

int q4_supported(void);
int q4_isa_supported(int isa);
int q4_matmul(int isa, const void* x, int x_bf16, float* widened, int64_t M, int64_t K,
              const uint8_t* codes, const float* scales, const float* mins, int64_t N, void* out,
              int out_bf16);

int q8_supported(void);
int q8_isa_supported(int isa);
int q8_matmul(int isa, const float* x, int64_t M, int64_t K, const int8_t* codes,
              const float* scales, int64_t N, float* out);

int quant_dot_supported(void);
int quant_dot_isa_supported(int isa);
int quant_dot_quantize(const void* x, int x_bf16, int64_t M, int64_t K, int8_t* codes, float* dx,
                       float* sx);
int quant_dot_matmul(int isa, const void* x, int x_bf16, int64_t M, int64_t K,
                     const uint8_t* weight_codes, int bits, const float* scales,
                     const float* mins, int64_t N, void* out, int out_bf16);

int decode_attention_supported(void);
int decode_attention_isa_supported(int isa);
int decode_attention(int isa, const void* query, int64_t query_row_stride,
                     int64_t query_head_stride, const void* k_cache, const void* v_cache,
                     int bf16, int kv_int8, const int64_t* rows, const int32_t* context_lens,
                     const int32_t* block_tables, int64_t table_stride, int64_t num_seqs,
                     int64_t num_kv_heads, int64_t group,
                     int64_t head_dim, int64_t block_size, float scale, int64_t window,
                     void* out, int64_t out_row_stride, int64_t out_head_stride);

int layer_ops_supported(void);
int layer_ops_isa_supported(int isa);
int add_rms_norm(int isa, float* residual, const void* delta, int delta_bf16,
                 const void* weight, int weight_bf16, float eps, int64_t rows, int64_t hidden,
                 void* out, int out_bf16);
int rotary_write_kv(int isa, const void* qkv, int64_t qkv_row_stride, int bf16, int64_t tokens,
                    int64_t num_q, int64_t num_kv, int64_t head_dim, const float* cos,
                    const float* sin, const int64_t* slots, void* k_cache, void* v_cache,
                    void* q_out);
int silu_mul(int isa, const void* gate_up, int bf16, int64_t rows, int64_t width, void* out);

}  // extern "C"
