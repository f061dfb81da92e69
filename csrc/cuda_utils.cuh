// Helpers shared by shoal's CUDA ops: dtype dispatch, float conversion, 16-byte vectors and
// warp/block reductions.
//
// Only c10 CUDA headers are included (not ATen/cuda/CUDAContext.h): those pull in cuBLAS and
// cuSPARSE headers, which the ops do not need and which CPU build machines lack.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace shoal {

// ---------------------------------------------------------------------------------------------
// dtype dispatch: call fn(T{}) with T the CUDA type of `dtype` (float, __half, __nv_bfloat16).
// A generic lambda recovers it with `using T = decltype(tag);`.
// ---------------------------------------------------------------------------------------------
template <typename Fn>
void dispatch_float_types(at::ScalarType dtype, const char* op_name, Fn&& fn) {
  switch (dtype) {
    case at::ScalarType::Float:
      fn(float{});
      break;
    case at::ScalarType::Half:
      fn(__half{});
      break;
    case at::ScalarType::BFloat16:
      fn(__nv_bfloat16{});
      break;
    default:
      TORCH_CHECK(false, op_name, ": unsupported dtype ", dtype, " (float32, float16, bfloat16 only)");
  }
}

// ---------------------------------------------------------------------------------------------
// Scalar conversions. Arithmetic is always done in float; storage is T.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// ---------------------------------------------------------------------------------------------
// Packed vectors. Memory-bound kernels move data in 16-byte packs (kVec16<T> elements): the
// widest load a thread can issue (LDG.128), so a warp reads 512 contiguous bytes per
// instruction. `Packed<T, 1>` is the scalar fallback for rows whose size or alignment does not
// allow packs, so one kernel body serves both.
// ---------------------------------------------------------------------------------------------
template <typename T, int N>
struct alignas(sizeof(T) * N) Packed {
  T elems[N];
};

template <typename T>
inline constexpr int kVec16 = 16 / sizeof(T);  // elements per 16-byte pack

template <int N, typename T>
__device__ __forceinline__ Packed<T, N> load_packed(const T* ptr) {
  return *reinterpret_cast<const Packed<T, N>*>(ptr);
}

template <int N, typename T>
__device__ __forceinline__ void store_packed(T* ptr, const Packed<T, N>& v) {
  *reinterpret_cast<Packed<T, N>*>(ptr) = v;
}

// 16 bytes through the read-only (non-coherent) path, for data no thread writes during the kernel.
template <typename T>
__device__ __forceinline__ Packed<T, kVec16<T>> load_packed16_ro(const T* ptr) {
  uint4 raw = __ldg(reinterpret_cast<const uint4*>(ptr));
  return *reinterpret_cast<Packed<T, kVec16<T>>*>(&raw);
}

inline bool is_aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Where row r of a tensor seen as [rows, t.size(-1)] starts. The last dimension must be
// contiguous; the rows may be spaced out, as when q, k or v is a column slice of the fused qkv
// projection ([num_tokens, width] with a wider row stride) or a per-head view of one
// ([num_tokens, num_heads, head_size] with strides (qkv_width, head_size, 1)).
struct RowLayout {
  int64_t rows_per_group;  // size(-2) of a 3-D input, else 1
  int64_t group_stride;    // elements between groups (stride(0))
  int64_t row_stride;      // elements between rows inside a group (stride(1) of a 3-D input)

  __host__ __device__ int64_t offset(int64_t row) const {
    return (row / rows_per_group) * group_stride + (row % rows_per_group) * row_stride;
  }
  // Every row start is a multiple of `n` elements (so n-element packs stay aligned).
  bool strides_multiple_of(int64_t n) const { return group_stride % n == 0 && row_stride % n == 0; }
};

inline RowLayout row_layout(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() >= 1 && t.stride(-1) == 1, name, ": the last dimension must be contiguous");
  if (t.dim() == 1 || t.is_contiguous()) return {1, t.size(-1), 0};
  if (t.dim() == 2) return {1, t.stride(0), 0};
  TORCH_CHECK(t.dim() == 3, name, ": a non-contiguous input must be 2-D or 3-D, got ", t.sizes());
  return {t.size(1), t.stride(0), t.stride(1)};
}

// ---------------------------------------------------------------------------------------------
// Reductions.
// ---------------------------------------------------------------------------------------------
template <int kWidth = 32>
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = kWidth / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

template <int kWidth = 32>
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = kWidth / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// Sum (or max) over the block; every thread gets the result. `scratch` holds 32 floats.
// Two syncs: one so every warp's partial is visible, one so `scratch` can be reused after.
template <bool kMax>
__device__ __forceinline__ float block_reduce(float x, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, num_warps = (blockDim.x + 31) / 32;
  x = kMax ? warp_max(x) : warp_sum(x);
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  float identity = kMax ? -INFINITY : 0.0f;
  x = lane < num_warps ? scratch[lane] : identity;
  x = kMax ? warp_max(x) : warp_sum(x);
  __syncthreads();
  return x;
}

__device__ __forceinline__ float block_sum(float x, float* scratch) { return block_reduce<false>(x, scratch); }
__device__ __forceinline__ float block_max(float x, float* scratch) { return block_reduce<true>(x, scratch); }

// Multiprocessor count of the current device, cached per device: the attribute query is cheap
// but not free, and the launch heuristics ask on every call.
inline int num_sms() {
  static int cache[64] = {};  // one slot per device ordinal; a benign race writes the same value
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  if (cache[device] == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&cache[device], cudaDevAttrMultiProcessorCount, device));
  }
  return cache[device];
}

}  // namespace shoal
