// The SwiGLU gate: out = silu(x[..., :d]) * x[..., d:]; reference: shoal/kernels/silu_and_mul.py.
//
// One block per row, 16-byte packs of gate and up. Rounding follows the reference: silu is
// computed in float32 and rounded to the dtype (as F.silu does), then multiplied by up and
// rounded again.
#include "cuda_utils.cuh"
#include "ops.h"

namespace shoal {
namespace {

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

template <typename T, int N>
__global__ void silu_and_mul_kernel(T* __restrict__ out, RowLayout out_layout, const T* __restrict__ x,
                                    RowLayout x_layout, int d) {
  const T* gate = x + x_layout.offset(blockIdx.x);  // [d]
  const T* up = gate + d;                            // [d]
  T* out_row = out + out_layout.offset(blockIdx.x);  // [d]
  for (int i = threadIdx.x; i < d / N; i += blockDim.x) {
    const Packed<T, N> g = load_packed<N>(gate + i * N);
    const Packed<T, N> u = load_packed<N>(up + i * N);
    Packed<T, N> o;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const T activated = from_float<T>(silu(to_float(g.elems[j])));
      o.elems[j] = from_float<T>(to_float(activated) * to_float(u.elems[j]));
    }
    store_packed(out_row + i * N, o);
  }
}

}  // namespace

void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda() && out.is_cuda(), "silu_and_mul: tensors must be on the GPU");
  TORCH_CHECK(x.scalar_type() == out.scalar_type(), "silu_and_mul: out and x must share a dtype");
  const int d = x.size(-1) / 2;
  TORCH_CHECK(x.size(-1) == 2 * d && out.size(-1) == d, "silu_and_mul: x [..., 2d] and out [..., d] expected");
  const int64_t num_rows = out.numel() / std::max(d, 1);
  TORCH_CHECK(x.numel() == 2 * d * num_rows, "silu_and_mul: x and out have different row counts");
  if (num_rows == 0) return;
  const RowLayout x_layout = row_layout(x, "silu_and_mul x"), out_layout = row_layout(out, "silu_and_mul out");
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float_types(x.scalar_type(), "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    constexpr int N = kVec16<T>;
    // d % N keeps the up half (x + d) aligned as well as the gate half.
    const bool packed = d % N == 0 && x_layout.strides_multiple_of(N) && out_layout.strides_multiple_of(N) &&
                        is_aligned16(x.data_ptr()) && is_aligned16(out.data_ptr());
    const int n = packed ? N : 1;
    const int threads = std::min(1024, std::max(32, (d / n + 31) / 32 * 32));
    auto* out_ptr = reinterpret_cast<T*>(out.data_ptr());
    const auto* x_ptr = reinterpret_cast<const T*>(x.data_ptr());
    if (packed) {
      silu_and_mul_kernel<T, N><<<num_rows, threads, 0, stream>>>(out_ptr, out_layout, x_ptr, x_layout, d);
    } else {
      silu_and_mul_kernel<T, 1><<<num_rows, threads, 0, stream>>>(out_ptr, out_layout, x_ptr, x_layout, d);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace shoal
