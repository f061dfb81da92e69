// RMSNorm and its fused residual-add variant; reference: shoal/kernels/rms_norm.py.
//
// One block per row. Pass 1 reads the row and reduces the sum of squares over the block; pass
// 2 reads it again (an L1/L2 hit: a row is a few KB) and writes the normalized row. Each thread
// touches the same packs in both passes, so the fused variant can write the new residual in
// pass 1 and read it back in pass 2 without a barrier.
//
// Rounding follows the reference (Hugging Face's LlamaRMSNorm): normalize in float32, round to
// the input dtype, then multiply by the weight and round again.
#include "cuda_utils.cuh"
#include "ops.h"

namespace shoal {
namespace {

template <typename T, int N>
__global__ void rms_norm_kernel(T* __restrict__ out, RowLayout out_layout, const T* __restrict__ x,
                                RowLayout x_layout, const T* __restrict__ weight, int hidden_size, float eps) {
  __shared__ float scratch[32];
  const T* x_row = x + x_layout.offset(blockIdx.x);
  T* out_row = out + out_layout.offset(blockIdx.x);
  const int num_packs = hidden_size / N;

  float sum_squares = 0.0f;
  for (int i = threadIdx.x; i < num_packs; i += blockDim.x) {
    const Packed<T, N> v = load_packed<N>(x_row + i * N);
#pragma unroll
    for (int j = 0; j < N; ++j) sum_squares += to_float(v.elems[j]) * to_float(v.elems[j]);
  }
  const float inv_rms = rsqrtf(block_sum(sum_squares, scratch) / hidden_size + eps);

  for (int i = threadIdx.x; i < num_packs; i += blockDim.x) {
    const Packed<T, N> v = load_packed<N>(x_row + i * N);
    const Packed<T, N> w = load_packed<N>(weight + i * N);
    Packed<T, N> o;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const T normed = from_float<T>(to_float(v.elems[j]) * inv_rms);
      o.elems[j] = from_float<T>(to_float(w.elems[j]) * to_float(normed));
    }
    store_packed(out_row + i * N, o);
  }
}

// residual = x + residual (rounded to T); x = rms_norm(residual) * weight.
template <typename T, int N>
__global__ void fused_add_rms_norm_kernel(T* x, RowLayout x_layout, T* residual, RowLayout residual_layout,
                                          const T* __restrict__ weight, int hidden_size, float eps) {
  __shared__ float scratch[32];
  T* x_row = x + x_layout.offset(blockIdx.x);
  T* residual_row = residual + residual_layout.offset(blockIdx.x);
  const int num_packs = hidden_size / N;

  float sum_squares = 0.0f;
  for (int i = threadIdx.x; i < num_packs; i += blockDim.x) {
    const Packed<T, N> a = load_packed<N>(x_row + i * N);
    Packed<T, N> r = load_packed<N>(residual_row + i * N);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      r.elems[j] = from_float<T>(to_float(a.elems[j]) + to_float(r.elems[j]));
      sum_squares += to_float(r.elems[j]) * to_float(r.elems[j]);
    }
    store_packed(residual_row + i * N, r);
  }
  const float inv_rms = rsqrtf(block_sum(sum_squares, scratch) / hidden_size + eps);

  for (int i = threadIdx.x; i < num_packs; i += blockDim.x) {
    const Packed<T, N> r = load_packed<N>(residual_row + i * N);  // this thread's own write
    const Packed<T, N> w = load_packed<N>(weight + i * N);
    Packed<T, N> o;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const T normed = from_float<T>(to_float(r.elems[j]) * inv_rms);
      o.elems[j] = from_float<T>(to_float(w.elems[j]) * to_float(normed));
    }
    store_packed(x_row + i * N, o);
  }
}

// Enough threads for one pack each, in whole warps, at most 1024.
int threads_for(int num_packs) { return std::min(1024, std::max(32, (num_packs + 31) / 32 * 32)); }

void check_inputs(const at::Tensor& x, const at::Tensor& other, const at::Tensor& weight, const char* name) {
  TORCH_CHECK(x.is_cuda() && other.is_cuda() && weight.is_cuda(), name, ": tensors must be on the GPU");
  TORCH_CHECK(x.sizes() == other.sizes(), name, ": shape mismatch ", x.sizes(), " vs ", other.sizes());
  TORCH_CHECK(x.scalar_type() == other.scalar_type() && x.scalar_type() == weight.scalar_type(), name,
              ": x, weight and out/residual must share a dtype");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(-1), name, ": weight must be [hidden_size]");
}

}  // namespace

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_inputs(x, out, weight, "rms_norm");
  const int hidden_size = x.size(-1);
  const int64_t num_rows = x.numel() / std::max(hidden_size, 1);
  if (num_rows == 0) return;
  const RowLayout x_layout = row_layout(x, "rms_norm x"), out_layout = row_layout(out, "rms_norm out");
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float_types(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    constexpr int N = kVec16<T>;
    const bool packed = hidden_size % N == 0 && x_layout.strides_multiple_of(N) && out_layout.strides_multiple_of(N) &&
                        is_aligned16(x.data_ptr()) && is_aligned16(out.data_ptr()) && is_aligned16(weight.data_ptr());
    auto* out_ptr = reinterpret_cast<T*>(out.data_ptr());
    const auto* x_ptr = reinterpret_cast<const T*>(x.data_ptr());
    const auto* w_ptr = reinterpret_cast<const T*>(weight.data_ptr());
    if (packed) {
      rms_norm_kernel<T, N><<<num_rows, threads_for(hidden_size / N), 0, stream>>>(
          out_ptr, out_layout, x_ptr, x_layout, w_ptr, hidden_size, static_cast<float>(eps));
    } else {
      rms_norm_kernel<T, 1><<<num_rows, threads_for(hidden_size), 0, stream>>>(
          out_ptr, out_layout, x_ptr, x_layout, w_ptr, hidden_size, static_cast<float>(eps));
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_inputs(x, residual, weight, "fused_add_rms_norm");
  const int hidden_size = x.size(-1);
  const int64_t num_rows = x.numel() / std::max(hidden_size, 1);
  if (num_rows == 0) return;
  const RowLayout x_layout = row_layout(x, "fused_add_rms_norm x");
  const RowLayout residual_layout = row_layout(residual, "fused_add_rms_norm residual");
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float_types(x.scalar_type(), "fused_add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    constexpr int N = kVec16<T>;
    const bool packed = hidden_size % N == 0 && x_layout.strides_multiple_of(N) &&
                        residual_layout.strides_multiple_of(N) && is_aligned16(x.data_ptr()) &&
                        is_aligned16(residual.data_ptr()) && is_aligned16(weight.data_ptr());
    auto* x_ptr = reinterpret_cast<T*>(x.data_ptr());
    auto* r_ptr = reinterpret_cast<T*>(residual.data_ptr());
    const auto* w_ptr = reinterpret_cast<const T*>(weight.data_ptr());
    if (packed) {
      fused_add_rms_norm_kernel<T, N><<<num_rows, threads_for(hidden_size / N), 0, stream>>>(
          x_ptr, x_layout, r_ptr, residual_layout, w_ptr, hidden_size, static_cast<float>(eps));
    } else {
      fused_add_rms_norm_kernel<T, 1><<<num_rows, threads_for(hidden_size), 0, stream>>>(
          x_ptr, x_layout, r_ptr, residual_layout, w_ptr, hidden_size, static_cast<float>(eps));
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace shoal
