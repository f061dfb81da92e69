// fp8 e4m3 x fp8 e4m3 -> bf16/fp16 GEMM with scales and optional bias, CUTLASS 3.x on sm90;
// reference: shoal/kernels/cutlass_scaled_mm.py.
//
//   out[m, n] = a_scale[m] * b_scale[n] * sum_k a[m, k] * b[k, n] + bias[n]
//
// a [M, K] row-major, b [K, N] column-major (b.t() is a contiguous [N, K]: both operands are
// K-major, the only layout fp8 wgmma reads); a_scale is [1] or [M] (per token), b_scale [1] or
// [N] (per channel), bias [N] or absent.
//
// The mainloop is CUTLASS's TMA warp-specialized cooperative kernel (two consumer warpgroups
// issue wgmma on one tile while a producer warp streams tiles in with TMA), with the
// stream-K tile scheduler, which splits K across CTAs when there are too few output tiles to
// fill the GPU (decode-sized M). The scales and bias are applied in the epilogue by an
// epilogue visitor tree (EVT), so the fp32 accumulators are scaled in registers and written
// once as bf16/fp16:
//
//   D = row_scale * (col_scale * acc) + bias
//
// Row and column scales are broadcast nodes whose stride is a run-time bool: true reads a
// vector, false reads element 0 everywhere, so per-tensor and per-token/per-channel scales
// share one kernel.
//
// Small M (decode) runs "swapped": CUTLASS computes out^T = b^T a^T, so the large N fills the
// 128-row tile and the few tokens fill a narrow 16/64-column tile instead of wasting most of a
// 128-row tile. Then the scale roles swap (b_scale scales rows, a_scale columns), the bias is
// per row, and D^T is stored column-major, which is `out` row-major.
#include <ATen/ops/empty.h>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_compute_tma_warpspecialized.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_load_tma_warpspecialized.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>

#include "cuda_utils.cuh"
#include "ops.h"

namespace shoal {
namespace {

using namespace cute;
namespace fusion = cutlass::epilogue::fusion;

constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

// D = row_scale * (col_scale * acc) + bias, computed in float, rounded once to ElementD.
template <typename ElementD, typename TileShape, bool kSwapAB>
struct ScaledEpilogue {
  using RowScale = fusion::Sm90ColBroadcast<0, TileShape, float, float, Stride<bool, _0, _0>>;  // [rows] or [1]
  using ColScale = fusion::Sm90RowBroadcast<0, TileShape, float, float, Stride<_0, bool, _0>>;  // [cols] or [1]
  // The bias runs along N: columns of out, rows of the swapped out^T. A null pointer reads 0.
  using Bias = cute::conditional_t<kSwapAB, fusion::Sm90ColBroadcast<0, TileShape, ElementD, float, Stride<_1, _0, _0>>,
                                   fusion::Sm90RowBroadcast<0, TileShape, ElementD, float, Stride<_0, _1, _0>>>;
  using ScaledAcc = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>, ColScale,
                                    fusion::Sm90AccFetch>;
  using Tree = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::homogeneous_multiply_add, ElementD, float, kRound>,
                               RowScale, ScaledAcc, Bias>;

  // Each node's arguments are {children..., op}; a broadcast's are {ptr, null_default, stride}.
  static typename Tree::Arguments arguments(const float* row_scale, bool row_vector, const float* col_scale,
                                            bool col_vector, const ElementD* bias) {
    using BiasStride = typename Bias::StrideMNL;
    return {
        {row_scale, 0.0f, {row_vector, _0{}, _0{}}},                   // RowScale
        {{col_scale, 0.0f, {_0{}, col_vector, _0{}}}, {}, {}},         // ScaledAcc: ColScale, acc, multiplies
        {bias, ElementD(0), BiasStride{}},                             // Bias (nullptr: none)
        {}                                                             // multiply_add
    };
  }
};

// One GEMM configuration: tile, cluster and whether A and B trade places.
template <typename ElementD, typename TileShape, typename ClusterShape, bool SwapAB>
struct GemmConfig {
  static constexpr bool kSwapAB = SwapAB;
  using ElementAB = cutlass::float_e4m3_t;
  using Epilogue = ScaledEpilogue<ElementD, TileShape, SwapAB>;
  // Computed D is [M, N] row-major, or D^T = [N, M] column-major when swapped; both are `out`.
  using LayoutD = cute::conditional_t<SwapAB, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  static constexpr int kAlignAB = 16;                      // 16 bytes of fp8 (TMA)
  static constexpr int kAlignD = 16 / sizeof(ElementD);    // 16 bytes of bf16/fp16

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD, kAlignD,  // no source matrix C
      ElementD, LayoutD, kAlignD, cutlass::epilogue::TmaWarpSpecializedCooperative,
      typename Epilogue::Tree>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, cutlass::layout::RowMajor, kAlignAB,
      ElementAB, cutlass::layout::ColumnMajor, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      // FP8FastAccum: wgmma accumulates without periodic promotion to full fp32; faster, and
      // within bf16 output rounding at LLM shapes.
      cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue, cutlass::gemm::StreamKScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

#define SHOAL_CUTLASS_CHECK(status, what)                                                                 \
  TORCH_CHECK((status) == cutlass::Status::kSuccess, "cutlass_scaled_mm: ", what, " failed: ",           \
              cutlassGetStatusString(status))

template <typename Config, typename ElementD>
void run_gemm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale,
              const at::Tensor& b_scale, const std::optional<at::Tensor>& bias, cudaStream_t stream) {
  using Gemm = typename Config::Gemm;
  using Kernel = typename Gemm::GemmKernel;
  using StrideA = typename Kernel::StrideA;
  using StrideB = typename Kernel::StrideB;
  using StrideC = typename Kernel::StrideC;
  using StrideD = typename Kernel::StrideD;
  constexpr bool kSwapAB = Config::kSwapAB;

  const int m = a.size(0), n = b.size(1), k = a.size(1);
  const auto* a_ptr = reinterpret_cast<const cutlass::float_e4m3_t*>(a.data_ptr());
  const auto* b_ptr = reinterpret_cast<const cutlass::float_e4m3_t*>(b.data_ptr());
  const int64_t lda = a.stride(0), ldb = b.stride(1), ldd = out.stride(0);  // K-major a and b, N-major out
  const auto* bias_ptr = bias ? reinterpret_cast<const ElementD*>(bias->data_ptr()) : nullptr;
  const bool a_vector = a_scale.numel() > 1, b_vector = b_scale.numel() > 1;

  // Operands as CUTLASS sees them: A' [M', K] and B' [N', K], both K-major.
  const int gemm_m = kSwapAB ? n : m, gemm_n = kSwapAB ? m : n;
  const StrideA stride_a = make_stride(kSwapAB ? ldb : lda, _1{}, int64_t(0));
  const StrideB stride_b = make_stride(kSwapAB ? lda : ldb, _1{}, int64_t(0));
  StrideD stride_d;
  if constexpr (kSwapAB) stride_d = make_stride(_1{}, ldd, int64_t(0));  // D^T[n', m'] at m' * ldd + n'
  else stride_d = make_stride(ldd, _1{}, int64_t(0));
  const float* row_scale = (kSwapAB ? b_scale : a_scale).data_ptr<float>();
  const float* col_scale = (kSwapAB ? a_scale : b_scale).data_ptr<float>();
  const bool row_vector = kSwapAB ? b_vector : a_vector, col_vector = kSwapAB ? a_vector : b_vector;

  cutlass::KernelHardwareInfo hw_info;
  hw_info.device_id = a.get_device();
  hw_info.sm_count = num_sms();
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {gemm_m, gemm_n, k, 1},
      {kSwapAB ? b_ptr : a_ptr, stride_a, kSwapAB ? a_ptr : b_ptr, stride_b},
      {Config::Epilogue::arguments(row_scale, row_vector, col_scale, col_vector, bias_ptr), nullptr, StrideC{},
       reinterpret_cast<ElementD*>(out.data_ptr()), stride_d},
      hw_info};

  Gemm gemm;
  SHOAL_CUTLASS_CHECK(gemm.can_implement(args), "can_implement");
  // Stream-K keeps partial tiles in the workspace; the torch allocator makes it cheap per call.
  const size_t workspace_bytes = Gemm::get_workspace_size(args);
  at::Tensor workspace = at::empty({static_cast<int64_t>(std::max<size_t>(workspace_bytes, 1))}, a.options().dtype(at::kByte));
  SHOAL_CUTLASS_CHECK(gemm.run(args, workspace.data_ptr(), stream), "run");
}

// Tile by M: decode batches swap A and B and use a narrow tile over the tokens; larger M uses
// 128-row tiles, 256 columns wide once M is large enough to fill them.
template <typename ElementD>
void dispatch_by_m(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale,
                   const at::Tensor& b_scale, const std::optional<at::Tensor>& bias, cudaStream_t stream) {
  const int m = a.size(0);
  if (m <= 16) {
    run_gemm<GemmConfig<ElementD, Shape<_128, _16, _128>, Shape<_1, _1, _1>, true>, ElementD>(out, a, b, a_scale,
                                                                                           b_scale, bias, stream);
  } else if (m <= 64) {
    run_gemm<GemmConfig<ElementD, Shape<_128, _64, _128>, Shape<_1, _1, _1>, true>, ElementD>(out, a, b, a_scale,
                                                                                           b_scale, bias, stream);
  } else if (m <= 256) {
    run_gemm<GemmConfig<ElementD, Shape<_128, _128, _128>, Shape<_1, _1, _1>, false>, ElementD>(out, a, b, a_scale,
                                                                                              b_scale, bias, stream);
  } else {
    run_gemm<GemmConfig<ElementD, Shape<_128, _256, _128>, Shape<_2, _1, _1>, false>, ElementD>(out, a, b, a_scale,
                                                                                              b_scale, bias, stream);
  }
}

}  // namespace

void cutlass_scaled_mm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale,
                       const at::Tensor& b_scale, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(a.is_cuda() && b.is_cuda() && out.is_cuda() && a_scale.is_cuda() && b_scale.is_cuda(),
              "cutlass_scaled_mm: tensors must be on the GPU");
  TORCH_CHECK(a.scalar_type() == at::kFloat8_e4m3fn && b.scalar_type() == at::kFloat8_e4m3fn,
              "cutlass_scaled_mm: a and b must be float8_e4m3fn");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0), "cutlass_scaled_mm: a [M, K] and b [K, N]");
  TORCH_CHECK(a.stride(1) == 1, "cutlass_scaled_mm: a must be row-major");
  TORCH_CHECK(b.stride(0) == 1, "cutlass_scaled_mm: b must be column-major (b.t() contiguous)");
  const int64_t m = a.size(0), n = b.size(1), k = a.size(1);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.size(1) == n && out.stride(1) == 1,
              "cutlass_scaled_mm: out must be row-major [M, N]");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kHalf,
              "cutlass_scaled_mm: out must be bfloat16 or float16");
  TORCH_CHECK(a_scale.scalar_type() == at::kFloat && b_scale.scalar_type() == at::kFloat && a_scale.is_contiguous() &&
                  b_scale.is_contiguous(),
              "cutlass_scaled_mm: scales must be contiguous float32");
  TORCH_CHECK(a_scale.numel() == 1 || a_scale.numel() == m, "cutlass_scaled_mm: a_scale must be [1] or [M]");
  TORCH_CHECK(b_scale.numel() == 1 || b_scale.numel() == n, "cutlass_scaled_mm: b_scale must be [1] or [N]");
  if (bias) {
    TORCH_CHECK(bias->is_cuda() && bias->scalar_type() == out.scalar_type() && bias->is_contiguous() &&
                    bias->numel() == n,
                "cutlass_scaled_mm: bias must be contiguous [N] in the output dtype");
  }
  // TMA needs 16-byte aligned rows: K fp8 elements for a and b, N (or ldd) bf16 elements for out.
  TORCH_CHECK(k > 0 && k % 16 == 0 && a.stride(0) % 16 == 0 && b.stride(1) % 16 == 0, "cutlass_scaled_mm: K must be a multiple of 16");
  TORCH_CHECK(n % 8 == 0 && out.stride(0) % 8 == 0, "cutlass_scaled_mm: N must be a multiple of 8");
  TORCH_CHECK(is_aligned16(a.data_ptr()) && is_aligned16(b.data_ptr()) && is_aligned16(out.data_ptr()),
              "cutlass_scaled_mm: a, b and out must be 16-byte aligned");
  if (m == 0 || n == 0) return;

  const c10::cuda::OptionalCUDAGuard guard(a.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (out.scalar_type() == at::kBFloat16) {
    dispatch_by_m<cutlass::bfloat16_t>(out, a, b, a_scale, b_scale, bias, stream);
  } else {
    dispatch_by_m<cutlass::half_t>(out, a, b, a_scale, b_scale, bias, stream);
  }
}

}  // namespace shoal
