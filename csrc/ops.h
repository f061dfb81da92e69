// The host entry points of shoal's CUDA ops, one per csrc/<op>.cu; torch_bindings.cpp gives
// each its schema and registers it for the CUDA dispatch key. Semantics: shoal/kernels/<op>.py.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace shoal {

// rms_norm.cu
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);

// rotary_embedding.cu
void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key, int64_t head_size,
                      const at::Tensor& cos_sin_cache, bool is_neox);

// silu_and_mul.cu
void silu_and_mul(at::Tensor& out, const at::Tensor& x);

// reshape_and_cache.cu
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                       const at::Tensor& slot_mapping);

// paged_attention.cu
void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_tables,
                     int64_t max_query_len, int64_t max_seq_len, double scale, int64_t num_splits);

// scaled_fp8_quant.cu
void scaled_fp8_quant(at::Tensor& out, const at::Tensor& input, at::Tensor& scale, bool is_static, bool per_token);

// cutlass_scaled_mm.cu
void cutlass_scaled_mm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale,
                       const at::Tensor& b_scale, const std::optional<at::Tensor>& bias);

// moe_align_block_size.cu
void moe_align_block_size(const at::Tensor& topk_ids, int64_t num_experts, int64_t block_size,
                          at::Tensor& sorted_token_ids, at::Tensor& expert_ids, at::Tensor& num_tokens_post_padded);

// sleep_memory.cu: the allocator behind enable_sleep_mode (no tensors: host-side control of the
// registry of allocations; the allocator's own entry points are extern "C" there).
void sleep_memory_set_tag(int64_t tag);
int64_t sleep_memory_release(int64_t tag, bool keep_contents);
int64_t sleep_memory_restore(int64_t tag);
int64_t sleep_memory_mapped_bytes(int64_t tag);

}  // namespace shoal
