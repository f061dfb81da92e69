// Quantize to fp8 e4m3 with a static per-tensor scale, a dynamic per-tensor scale or dynamic
// per-token scales; reference: shoal/kernels/scaled_fp8_quant.py.
//
//   out = saturate_e4m3(x / scale),  scale = max(amax / 448, kMinScale)  (dynamic modes)
//
// x / scale is an IEEE division and the e4m3 conversion rounds to nearest even, exactly as the
// reference's float32 ops and `.to(torch.float8_e4m3fn)`, so results match bit for bit.
// One block per row; rows move in 16-byte packs.
#include <ATen/ops/zeros.h>
#include <cuda_fp8.h>

#include "cuda_utils.cuh"
#include "ops.h"

namespace shoal {
namespace {

constexpr float kFp8Max = 448.0f;  // largest finite e4m3 value
// Floor of a dynamic scale so that an all-zero row does not divide by zero; computed in double
// and rounded once, as Python computes the reference's constant.
constexpr float kMinScale = static_cast<float>(1.0 / (448.0 * 512.0));
constexpr int kThreads = 256;

__device__ __forceinline__ uint8_t quantize(float x, float scale) {
  return __nv_cvt_float_to_fp8(__fdiv_rn(x, scale), __NV_SATFINITE, __NV_E4M3);
}

template <typename T, int N>
__device__ float row_amax(const T* row, int cols) {
  float amax = 0.0f;
  for (int i = threadIdx.x; i < cols / N; i += blockDim.x) {
    const Packed<T, N> v = load_packed<N>(row + i * N);
#pragma unroll
    for (int j = 0; j < N; ++j) amax = fmaxf(amax, fabsf(to_float(v.elems[j])));
  }
  return amax;
}

template <typename T, int N>
__device__ void quantize_row(uint8_t* out_row, const T* row, int cols, float scale) {
  for (int i = threadIdx.x; i < cols / N; i += blockDim.x) {
    const Packed<T, N> v = load_packed<N>(row + i * N);
    Packed<uint8_t, N> q;
#pragma unroll
    for (int j = 0; j < N; ++j) q.elems[j] = quantize(to_float(v.elems[j]), scale);
    store_packed(out_row + i * N, q);
  }
}

// Per-tensor amax: blocks stride over rows, each folds its rows into one atomicMax. Non-negative
// floats order like their bit patterns as ints, so an integer atomicMax is a float max.
template <typename T, int N>
__global__ void tensor_amax_kernel(float* __restrict__ amax, const T* __restrict__ x, RowLayout layout,
                                   int64_t rows, int cols) {
  __shared__ float scratch[32];
  float local = 0.0f;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) local = fmaxf(local, row_amax<T, N>(x + layout.offset(r), cols));
  local = block_max(local, scratch);
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<int*>(amax), __float_as_int(local));
}

// scale_or_amax is the static scale, or (dynamic) the tensor amax from which block 0 writes the scale.
template <typename T, int N>
__global__ void tensor_quant_kernel(uint8_t* __restrict__ out, const T* __restrict__ x, RowLayout layout, int cols,
                                    const float* __restrict__ scale_or_amax, float* __restrict__ scale_out,
                                    bool dynamic) {
  const float scale = dynamic ? fmaxf(*scale_or_amax / kFp8Max, kMinScale) : *scale_or_amax;
  if (dynamic && blockIdx.x == 0 && threadIdx.x == 0) *scale_out = scale;
  quantize_row<T, N>(out + static_cast<int64_t>(blockIdx.x) * cols, x + layout.offset(blockIdx.x), cols, scale);
}

template <typename T, int N>
__global__ void token_quant_kernel(uint8_t* __restrict__ out, const T* __restrict__ x, RowLayout layout, int cols,
                                   float* __restrict__ scales) {
  __shared__ float scratch[32];
  const T* row = x + layout.offset(blockIdx.x);
  const float scale = fmaxf(block_max(row_amax<T, N>(row, cols), scratch) / kFp8Max, kMinScale);
  if (threadIdx.x == 0) scales[blockIdx.x] = scale;
  quantize_row<T, N>(out + static_cast<int64_t>(blockIdx.x) * cols, row, cols, scale);  // row re-read from L1/L2
}

}  // namespace

void scaled_fp8_quant(at::Tensor& out, const at::Tensor& input, at::Tensor& scale, bool is_static, bool per_token) {
  TORCH_CHECK(out.is_cuda() && input.is_cuda() && scale.is_cuda(), "scaled_fp8_quant: tensors must be on the GPU");
  TORCH_CHECK(out.scalar_type() == at::kFloat8_e4m3fn && out.is_contiguous() && out.sizes() == input.sizes(),
              "scaled_fp8_quant: out must be a contiguous float8_e4m3fn tensor shaped like input");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous(), "scaled_fp8_quant: scale must be float32");
  TORCH_CHECK(!(is_static && per_token), "scaled_fp8_quant: static scales are per-tensor only");
  const int cols = input.size(-1);
  const int64_t rows = cols == 0 ? 0 : input.numel() / cols;
  TORCH_CHECK(scale.numel() == (per_token ? rows : 1), "scaled_fp8_quant: scale must have ",
              per_token ? "one entry per row" : "one entry");
  if (rows == 0) return;
  const RowLayout layout = row_layout(input, "scaled_fp8_quant input");
  const c10::cuda::OptionalCUDAGuard guard(input.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor amax;
  if (!is_static && !per_token) amax = at::zeros({1}, input.options().dtype(at::kFloat));

  dispatch_float_types(input.scalar_type(), "scaled_fp8_quant", [&](auto tag) {
    using T = decltype(tag);
    constexpr int N = kVec16<T>;
    const bool packed = cols % N == 0 && layout.strides_multiple_of(N) && is_aligned16(input.data_ptr()) &&
                        is_aligned16(out.data_ptr());
    auto run = [&](auto n_tag) {
      constexpr int kN = decltype(n_tag)::value;
      auto* out_ptr = reinterpret_cast<uint8_t*>(out.data_ptr());
      const auto* x = reinterpret_cast<const T*>(input.data_ptr());
      float* scale_ptr = scale.data_ptr<float>();
      if (per_token) {
        token_quant_kernel<T, kN><<<rows, kThreads, 0, stream>>>(out_ptr, x, layout, cols, scale_ptr);
      } else if (is_static) {
        tensor_quant_kernel<T, kN><<<rows, kThreads, 0, stream>>>(out_ptr, x, layout, cols, scale_ptr, nullptr, false);
      } else {
        const int blocks = static_cast<int>(std::min<int64_t>(rows, 4 * num_sms()));
        tensor_amax_kernel<T, kN><<<blocks, kThreads, 0, stream>>>(amax.data_ptr<float>(), x, layout, rows, cols);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        tensor_quant_kernel<T, kN><<<rows, kThreads, 0, stream>>>(out_ptr, x, layout, cols, amax.data_ptr<float>(),
                                                                 scale_ptr, true);
      }
    };
    if (packed) run(std::integral_constant<int, N>{});
    else run(std::integral_constant<int, 1>{});
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace shoal
