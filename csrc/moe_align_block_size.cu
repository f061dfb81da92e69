// Group the (token, k) routing entries by expert, each expert's group padded to a multiple of
// block_size, for a fused-MoE GEMM that gives every block of rows to one expert; reference:
// shoal/kernels/moe_align_block_size.py.
//
// One thread block does it all, in shared memory: count entries per expert (shared atomics),
// exclusive-scan the padded counts into each expert's offset, label every row block with its
// expert (a binary search over the offsets, one thread per block), then scatter each entry
// to its expert's next free row. Entries of one expert land in arbitrary order (shared
// atomics race); the GEMM does not care, and the test compares each expert's rows as a set.
//
// Any number of experts that fits in shared memory (two ints per expert, dynamic shared
// memory): each thread scans a run of ceil(num_experts / kThreads) consecutive experts, so
// 256-expert models (DeepSeek-V3) and more take the same path as 8-expert ones.
#include <cub/block/block_scan.cuh>

#include "cuda_utils.cuh"
#include "ops.h"

namespace shoal {
namespace {

constexpr int kThreads = 1024;
constexpr int kMaxSharedBytes = 48 * 1024;  // without opting in to more per block

template <typename IdT>
__global__ void __launch_bounds__(kThreads)
    moe_align_block_size_kernel(const IdT* __restrict__ topk_ids, int numel, int num_experts, int block_size,
                                int* __restrict__ sorted_token_ids, int max_num_tokens_padded,
                                int* __restrict__ expert_ids, int max_num_blocks, int* __restrict__ num_tokens_post_padded) {
  using BlockScan = cub::BlockScan<int, kThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  extern __shared__ int s_shared[];
  int* s_cursor = s_shared;                // per expert: entry count, then the next free row
  int* s_offset = s_shared + num_experts;  // per expert: first row of its group; [num_experts] = total rows
  const int tid = threadIdx.x;
  const int experts_per_thread = (num_experts + kThreads - 1) / kThreads;
  const int first = tid * experts_per_thread;  // this thread's run of experts in the scan
  const int last = min(first + experts_per_thread, num_experts);

  for (int e = tid; e < num_experts; e += kThreads) s_cursor[e] = 0;
  __syncthreads();
  for (int i = tid; i < numel; i += kThreads) {
    const int expert = static_cast<int>(topk_ids[i]);
    if (expert >= 0 && expert < num_experts) atomicAdd(&s_cursor[expert], 1);  // others: not on this rank
  }
  __syncthreads();

  int run_rows = 0;  // padded rows of this thread's experts
  for (int e = first; e < last; ++e) run_rows += (s_cursor[e] + block_size - 1) / block_size * block_size;
  int offset, total;
  BlockScan(scan_storage).ExclusiveSum(run_rows, offset, total);
  for (int e = first; e < last; ++e) {
    const int padded = (s_cursor[e] + block_size - 1) / block_size * block_size;
    s_offset[e] = offset;
    s_cursor[e] = offset;
    offset += padded;
  }
  if (tid == 0) {
    s_offset[num_experts] = total;
    *num_tokens_post_padded = total;
  }
  for (int i = tid; i < max_num_tokens_padded; i += kThreads) sorted_token_ids[i] = numel;  // padding rows
  __syncthreads();  // offsets ready; padding written before the scatter overwrites real rows

  for (int b = tid; b < max_num_blocks; b += kThreads) {
    const int row = b * block_size;
    if (row >= total) {
      expert_ids[b] = -1;  // past the last group: no expert
      continue;
    }
    int lo = 0, hi = num_experts - 1;  // the last expert whose group starts at or before `row`
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (s_offset[mid] <= row) lo = mid;
      else hi = mid - 1;
    }
    expert_ids[b] = lo;
  }
  for (int i = tid; i < numel; i += kThreads) {
    const int expert = static_cast<int>(topk_ids[i]);
    if (expert >= 0 && expert < num_experts) sorted_token_ids[atomicAdd(&s_cursor[expert], 1)] = i;
  }
}

}  // namespace

void moe_align_block_size(const at::Tensor& topk_ids, int64_t num_experts, int64_t block_size,
                          at::Tensor& sorted_token_ids, at::Tensor& expert_ids, at::Tensor& num_tokens_post_padded) {
  TORCH_CHECK(topk_ids.is_cuda() && sorted_token_ids.is_cuda() && expert_ids.is_cuda() && num_tokens_post_padded.is_cuda(),
              "moe_align_block_size: tensors must be on the GPU");
  TORCH_CHECK(topk_ids.is_contiguous() && (topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong),
              "moe_align_block_size: topk_ids must be contiguous int32 or int64");
  // Two ints per expert (counts, offsets) and one total beside the scan's own storage: about 6,000 experts.
  constexpr int64_t kScanBytes = sizeof(cub::BlockScan<int, kThreads>::TempStorage);
  constexpr int64_t kMaxExperts = (kMaxSharedBytes - kScanBytes - sizeof(int)) / (2 * sizeof(int));
  TORCH_CHECK(num_experts >= 1 && num_experts <= kMaxExperts, "moe_align_block_size: 1 to ", kMaxExperts,
              " experts, got ", num_experts);
  const int64_t shared_bytes = (2 * num_experts + 1) * static_cast<int64_t>(sizeof(int));
  TORCH_CHECK(block_size >= 1, "moe_align_block_size: block_size must be positive");
  TORCH_CHECK(sorted_token_ids.scalar_type() == at::kInt && expert_ids.scalar_type() == at::kInt &&
                  num_tokens_post_padded.scalar_type() == at::kInt,
              "moe_align_block_size: outputs must be int32");
  const int64_t numel = topk_ids.numel();
  const int64_t max_rows = numel + num_experts * (block_size - 1);  // every expert's group padded by < block_size
  TORCH_CHECK(sorted_token_ids.numel() >= max_rows && expert_ids.numel() >= (max_rows + block_size - 1) / block_size,
              "moe_align_block_size: outputs too small for ", max_rows, " rows");
  TORCH_CHECK(max_rows < INT32_MAX, "moe_align_block_size: too many entries");
  const c10::cuda::OptionalCUDAGuard guard(topk_ids.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  auto launch = [&](auto id_tag) {
    using IdT = decltype(id_tag);
    moe_align_block_size_kernel<IdT><<<1, kThreads, static_cast<size_t>(shared_bytes), stream>>>(
        reinterpret_cast<const IdT*>(topk_ids.data_ptr()), static_cast<int>(numel), static_cast<int>(num_experts),
        static_cast<int>(block_size), sorted_token_ids.data_ptr<int>(), static_cast<int>(sorted_token_ids.numel()),
        expert_ids.data_ptr<int>(), static_cast<int>(expert_ids.numel()), num_tokens_post_padded.data_ptr<int>());
  };
  if (topk_ids.scalar_type() == at::kInt) launch(int32_t{});
  else launch(int64_t{});
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace shoal
