// Write this step's keys and values into the paged KV cache; reference:
// shoal/kernels/reshape_and_cache.py.
//
// kv_cache [2, num_blocks, block_size, num_kv_heads, head_size]: one token's keys (or values)
// are num_kv_heads * head_size contiguous elements at slot = block * block_size + offset, so
// each token is two dense row copies. One block per token copies both in 16-byte packs; a
// slot of -1 (padding) is skipped.
#include "cuda_utils.cuh"
#include "ops.h"

namespace shoal {
namespace {

template <typename T, int N>
__global__ void reshape_and_cache_kernel(const T* __restrict__ key, int64_t key_token_stride,
                                         const T* __restrict__ value, int64_t value_token_stride,
                                         T* __restrict__ key_cache, T* __restrict__ value_cache,
                                         const int64_t* __restrict__ slot_mapping, int row_size) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;  // padding token: nothing to write
  const T* key_row = key + token * key_token_stride;        // [num_kv_heads * head_size]
  const T* value_row = value + token * value_token_stride;  // [num_kv_heads * head_size]
  T* key_dst = key_cache + slot * row_size;
  T* value_dst = value_cache + slot * row_size;
  for (int i = threadIdx.x; i < row_size / N; i += blockDim.x) {
    store_packed(key_dst + i * N, load_packed<N>(key_row + i * N));
    store_packed(value_dst + i * N, load_packed<N>(value_row + i * N));
  }
}

// Elements between tokens of key or value [num_tokens, num_kv_heads, head_size], whose heads
// must be dense (a column slice of the fused qkv projection is).
int64_t token_stride(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "reshape_and_cache: ", name,
              " must be [num_tokens, num_kv_heads, head_size] with dense heads, got sizes ", x.sizes(),
              " strides ", x.strides());
  return x.stride(0);
}

}  // namespace

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                       const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.is_cuda() && value.is_cuda() && kv_cache.is_cuda() && slot_mapping.is_cuda(),
              "reshape_and_cache: tensors must be on the GPU");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "reshape_and_cache: kv_cache must be contiguous [2, num_blocks, block_size, num_kv_heads, head_size]");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type(),
              "reshape_and_cache: key, value and kv_cache must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "reshape_and_cache: slot_mapping must be contiguous int64");
  const int64_t num_tokens = key.size(0);
  TORCH_CHECK(value.size(0) == num_tokens && slot_mapping.numel() >= num_tokens,
              "reshape_and_cache: key, value and slot_mapping disagree on the token count");
  const int row_size = kv_cache.size(3) * kv_cache.size(4);  // num_kv_heads * head_size
  TORCH_CHECK(key.size(1) * key.size(2) == row_size && value.sizes() == key.sizes(),
              "reshape_and_cache: key/value heads do not match the cache");
  if (num_tokens == 0) return;
  const int64_t key_stride = token_stride(key, "key"), value_stride = token_stride(value, "value");
  const int64_t cache_half = kv_cache.numel() / 2;  // elements of kv_cache[0]

  const c10::cuda::OptionalCUDAGuard guard(key.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float_types(key.scalar_type(), "reshape_and_cache", [&](auto tag) {
    using T = decltype(tag);
    constexpr int N = kVec16<T>;
    const bool packed = row_size % N == 0 && key_stride % N == 0 && value_stride % N == 0 &&
                        cache_half % N == 0 && is_aligned16(key.data_ptr()) && is_aligned16(value.data_ptr()) &&
                        is_aligned16(kv_cache.data_ptr());
    const int n = packed ? N : 1;
    const int threads = std::min(512, std::max(32, (row_size / n + 31) / 32 * 32));
    const auto* key_ptr = reinterpret_cast<const T*>(key.data_ptr());
    const auto* value_ptr = reinterpret_cast<const T*>(value.data_ptr());
    auto* key_cache = reinterpret_cast<T*>(kv_cache.data_ptr());
    auto* value_cache = key_cache + cache_half;
    const auto* slots = slot_mapping.data_ptr<int64_t>();
    if (packed) {
      reshape_and_cache_kernel<T, N><<<num_tokens, threads, 0, stream>>>(key_ptr, key_stride, value_ptr, value_stride,
                                                                         key_cache, value_cache, slots, row_size);
    } else {
      reshape_and_cache_kernel<T, 1><<<num_tokens, threads, 0, stream>>>(key_ptr, key_stride, value_ptr, value_stride,
                                                                         key_cache, value_cache, slots, row_size);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace shoal
