// Rotary position embedding, in place on query and key; reference: shoal/kernels/rotary_embedding.py.
//
// One block per token; each thread rotates (head, pair) items of the query heads, then of the
// key heads. Neox style pairs feature i with i + rotary_dim / 2; GPT-J style pairs 2i with
// 2i + 1. cos_sin_cache[p] = [cos(p * inv_freq) (rotary_dim / 2), sin(p * inv_freq) (rotary_dim / 2)].
//
// Like the reference, cos and sin are first rounded to the query dtype; the rotation itself is
// computed in float32 and rounded once (the reference rounds each product in bf16/fp16, so
// results can differ there by one unit in the last place).
#include "cuda_utils.cuh"
#include "ops.h"

namespace shoal {
namespace {

template <typename T, typename CacheT, bool kNeox>
__device__ __forceinline__ void rotate_heads(T* base, int64_t row_offset, int num_heads, int head_size,
                                             int rotary_dim, const CacheT* cos_sin) {
  const int half = rotary_dim / 2;
  for (int item = threadIdx.x; item < num_heads * half; item += blockDim.x) {
    const int head = item / half, i = item % half;
    T* x = base + row_offset + static_cast<int64_t>(head) * head_size;
    const int i1 = kNeox ? i : 2 * i;         // first feature of the pair
    const int i2 = kNeox ? i + half : 2 * i + 1;  // its partner
    const float cos = to_float(from_float<T>(to_float(cos_sin[i])));  // round to T as the reference does
    const float sin = to_float(from_float<T>(to_float(cos_sin[half + i])));
    const float x1 = to_float(x[i1]), x2 = to_float(x[i2]);
    x[i1] = from_float<T>(x1 * cos - x2 * sin);
    x[i2] = from_float<T>(x2 * cos + x1 * sin);
  }
}

template <typename T, typename CacheT, typename PosT, bool kNeox>
__global__ void rotary_embedding_kernel(const PosT* __restrict__ positions, T* query, int64_t query_row_stride,
                                        int num_heads, T* key, int64_t key_row_stride, int num_kv_heads,
                                        int head_size, const CacheT* __restrict__ cos_sin_cache, int rotary_dim) {
  const int64_t token = blockIdx.x;
  const CacheT* cos_sin = cos_sin_cache + static_cast<int64_t>(positions[token]) * rotary_dim;  // [rotary_dim]
  rotate_heads<T, CacheT, kNeox>(query, token * query_row_stride, num_heads, head_size, rotary_dim, cos_sin);
  rotate_heads<T, CacheT, kNeox>(key, token * key_row_stride, num_kv_heads, head_size, rotary_dim, cos_sin);
}

// Row stride of q or k seen as [num_tokens, num_heads * head_size]: 2-D with a contiguous row,
// or 3-D [num_tokens, num_heads, head_size] with dense heads.
int64_t token_stride(const at::Tensor& x, int64_t head_size, const char* name) {
  TORCH_CHECK(x.stride(-1) == 1, "rotary_embedding: ", name, " must have a contiguous last dimension");
  TORCH_CHECK(x.dim() == 2 || (x.dim() == 3 && x.size(2) == head_size && x.stride(1) == head_size),
              "rotary_embedding: ", name, " must be [num_tokens, num_heads * head_size] or [num_tokens, num_heads, head_size]");
  return x.stride(0);
}

}  // namespace

void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key, int64_t head_size,
                      const at::Tensor& cos_sin_cache, bool is_neox) {
  TORCH_CHECK(query.is_cuda() && key.is_cuda() && positions.is_cuda() && cos_sin_cache.is_cuda(),
              "rotary_embedding: tensors must be on the GPU");
  TORCH_CHECK(query.scalar_type() == key.scalar_type(), "rotary_embedding: query and key must share a dtype");
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.is_contiguous(), "rotary_embedding: cos_sin_cache [max_position, rotary_dim]");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat || cos_sin_cache.scalar_type() == query.scalar_type(),
              "rotary_embedding: cos_sin_cache must be float32 or the query dtype");
  TORCH_CHECK(positions.is_contiguous() && (positions.scalar_type() == at::kLong || positions.scalar_type() == at::kInt),
              "rotary_embedding: positions must be contiguous int64 or int32");
  const int64_t num_tokens = query.size(0);
  TORCH_CHECK(positions.numel() == num_tokens && key.size(0) == num_tokens, "rotary_embedding: token counts differ");
  const int rotary_dim = cos_sin_cache.size(1);
  TORCH_CHECK(rotary_dim % 2 == 0 && rotary_dim <= head_size, "rotary_embedding: bad rotary_dim ", rotary_dim);
  if (num_tokens == 0) return;
  const int64_t query_row_stride = token_stride(query, head_size, "query");
  const int64_t key_row_stride = token_stride(key, head_size, "key");
  const int num_heads = query.numel() / num_tokens / head_size;
  const int num_kv_heads = key.numel() / num_tokens / head_size;
  const int items = std::max(num_heads, num_kv_heads) * rotary_dim / 2;
  const int threads = std::min(512, std::max(32, (items + 31) / 32 * 32));

  const c10::cuda::OptionalCUDAGuard guard(query.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float_types(query.scalar_type(), "rotary_embedding", [&](auto tag) {
    using T = decltype(tag);
    auto launch = [&](auto cache_tag, auto pos_tag) {
      using CacheT = decltype(cache_tag);
      using PosT = decltype(pos_tag);
      auto kernel = is_neox ? rotary_embedding_kernel<T, CacheT, PosT, true>
                            : rotary_embedding_kernel<T, CacheT, PosT, false>;
      kernel<<<num_tokens, threads, 0, stream>>>(
          reinterpret_cast<const PosT*>(positions.data_ptr()), reinterpret_cast<T*>(query.data_ptr()),
          query_row_stride, num_heads, reinterpret_cast<T*>(key.data_ptr()), key_row_stride, num_kv_heads,
          static_cast<int>(head_size), reinterpret_cast<const CacheT*>(cos_sin_cache.data_ptr()), rotary_dim);
    };
    const bool float_cache = cos_sin_cache.scalar_type() == at::kFloat;
    const bool long_positions = positions.scalar_type() == at::kLong;
    if (float_cache && long_positions) launch(float{}, int64_t{});
    else if (float_cache) launch(float{}, int32_t{});
    else if (long_positions) launch(T{}, int64_t{});
    else launch(T{}, int32_t{});
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace shoal
