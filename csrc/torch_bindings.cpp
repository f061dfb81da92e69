// The schemas of shoal's custom ops (torch.ops.shoal.<name>) and their CUDA implementations.
//
// Every op writes into tensors the caller allocated (`Tensor!` marks the ones it mutates) and
// returns nothing, so each can be captured in a CUDA graph and needs no autograd or fake-tensor
// rules beyond its schema. The Python wrapper beside each reference (shoal/kernels/<name>.py)
// allocates the outputs and calls the op through shoal/kernels/dispatch.py. The sleep_memory ops
// are the exception: they take no tensors (they release and restore the memory of the allocator
// behind enable_sleep_mode, shoal/kernels/sleep_memory.py), so they are registered for every
// dispatch key with their definition.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(shoal, m) {
  m.def("rms_norm(Tensor! out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor! x, Tensor! residual, Tensor weight, float eps) -> ()");
  m.def(
      "rotary_embedding(Tensor positions, Tensor! query, Tensor! key, int head_size, Tensor cos_sin_cache, "
      "bool is_neox) -> ()");
  m.def("silu_and_mul(Tensor! out, Tensor x) -> ()");
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor! kv_cache, Tensor slot_mapping) -> ()");
  // num_splits: how many parts each context is split into (split-K); 0 lets the op choose.
  m.def(
      "paged_attention(Tensor! out, Tensor query, Tensor kv_cache, Tensor query_start_loc, Tensor seq_lens, "
      "Tensor block_tables, int max_query_len, int max_seq_len, float scale, int num_splits=0) -> ()");
  // Static: `scale` [1] is read. Dynamic: `scale` ([1], or [num_rows] per token) is written.
  m.def("scaled_fp8_quant(Tensor! out, Tensor input, Tensor! scale, bool is_static, bool per_token) -> ()");
  m.def(
      "cutlass_scaled_mm(Tensor! out, Tensor a, Tensor b, Tensor a_scale, Tensor b_scale, Tensor? bias) -> ()");
  m.def(
      "moe_align_block_size(Tensor topk_ids, int num_experts, int block_size, Tensor! sorted_token_ids, "
      "Tensor! expert_ids, Tensor! num_tokens_post_padded) -> ()");
  m.def("sleep_memory_set_tag(int tag) -> ()", &shoal::sleep_memory_set_tag);
  m.def("sleep_memory_release(int tag, bool keep_contents) -> int", &shoal::sleep_memory_release);
  m.def("sleep_memory_restore(int tag) -> int", &shoal::sleep_memory_restore);
  m.def("sleep_memory_mapped_bytes(int tag) -> int", &shoal::sleep_memory_mapped_bytes);
}

TORCH_LIBRARY_IMPL(shoal, CUDA, m) {
  m.impl("rms_norm", &shoal::rms_norm);
  m.impl("fused_add_rms_norm", &shoal::fused_add_rms_norm);
  m.impl("rotary_embedding", &shoal::rotary_embedding);
  m.impl("silu_and_mul", &shoal::silu_and_mul);
  m.impl("reshape_and_cache", &shoal::reshape_and_cache);
  m.impl("paged_attention", &shoal::paged_attention);
  m.impl("scaled_fp8_quant", &shoal::scaled_fp8_quant);
  m.impl("cutlass_scaled_mm", &shoal::cutlass_scaled_mm);
  m.impl("moe_align_block_size", &shoal::moe_align_block_size);
}
