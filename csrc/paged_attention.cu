// Attention of each query token over its request's context in the paged KV cache, with
// grouped-query attention and a split-K variant; reference: shoal/kernels/paged_attention.py.
//
// Written for decode, where the kernel is bound by reading the KV cache once: every query
// token is scored on its own against positions [0, context_len), so a mixed batch also runs
// correctly (token j of a request of query_len q and seq_len s sees context_len s - q + j + 1),
// but re-reads the context once per prefill token. Mixed batches therefore go to the Triton
// kernel (shoal/kernels/triton/paged_attention.py) and this one serves decode.
//
// Work split. A thread block takes one query token, one KV head and up to MAX_G of the query
// heads that share it (GQA: the block reads each key and value once for all of them), and one
// split: a range of the context. With num_splits > 1 each split writes an unnormalized partial
// output with its softmax max and sum, and a second kernel combines the splits (the
// flash-decoding reduction); with one split the block writes the output directly.
//
// Inside a block the split is walked in chunks of kChunkTokens positions:
//   1. scores: each group of kLanesPerToken lanes reads one token's key row (16 bytes a lane,
//      a warp covers 32 / kLanesPerToken whole rows per load), dots it with the query heads it
//      holds in registers and reduces over the group with shuffles; scores go to shared memory.
//   2. softmax: one warp per head takes the chunk's max, exponentiates in place and updates the
//      running max and sum (online softmax across chunks: earlier accumulators are rescaled).
//   3. values: the same lanes read value rows and accumulate probability * value into
//      registers, per head and per dimension they own.
// At the end the lane groups, then the warps, add their accumulators.
//
// Bandwidth: keys and values move in 16-byte loads; kUnroll of them are issued per lane before
// the first is used, so a warp keeps kUnroll * 512 bytes in flight; a token's slot in the cache
// is computed once per chunk into shared memory, off the load path.
#include <ATen/ops/empty.h>

#include <cfloat>

#include "cuda_utils.cuh"
#include "ops.h"

namespace shoal {
namespace {

constexpr int kNumWarps = 4;
constexpr int kNumThreads = kNumWarps * 32;
constexpr int kChunkTokens = 256;  // positions scored per softmax step; their scores live in shared memory
constexpr int kUnroll = 4;         // 16-byte loads in flight per lane

template <typename T, int HEAD_SIZE, int MAX_G>
struct Config {
  static constexpr int kVec = kVec16<T>;                                    // elements per 16-byte load
  static constexpr int kLanesPerToken = HEAD_SIZE / kVec < 32 ? HEAD_SIZE / kVec : 32;  // lanes sharing a row
  static constexpr int kVecsPerLane = HEAD_SIZE / kVec / kLanesPerToken;    // loads per lane per row
  static constexpr int kRowsPerLoad = 32 / kLanesPerToken;                  // rows a warp-wide load covers
  static constexpr int kRowsPerWarpStep = kRowsPerLoad * kUnroll;
  static constexpr int kRowsPerStep = kRowsPerWarpStep * kNumWarps;
  // Shared floats: chunk scores [MAX_G][kChunkTokens], later reused for the per-warp
  // accumulators [kNumWarps][MAX_G][HEAD_SIZE].
  static constexpr int kScratchFloats =
      MAX_G * kChunkTokens > kNumWarps * MAX_G * HEAD_SIZE ? MAX_G * kChunkTokens : kNumWarps * MAX_G * HEAD_SIZE;
  static_assert(HEAD_SIZE % kVec == 0 && (HEAD_SIZE / kVec) % kLanesPerToken == 0, "head size must fill whole loads");
  static_assert(32 % kLanesPerToken == 0, "a warp must hold whole rows");
};

template <typename T>
struct Params {
  T* out;                          // [num_tokens, num_heads, head_size] (strided)
  const T* query;                  // [num_tokens, num_heads, head_size] (strided)
  const T* key_cache;              // [num_blocks, block_size, num_kv_heads, head_size]
  const T* value_cache;            // [num_blocks, block_size, num_kv_heads, head_size]
  float* partial_out;              // [num_tokens, num_heads, num_splits, head_size] (num_splits > 1)
  float* partial_max;              // [num_tokens, num_heads, num_splits]
  float* partial_sum;              // [num_tokens, num_heads, num_splits]
  const int* query_start_loc;      // [num_reqs + 1]
  const int* seq_lens;             // [num_reqs]
  const int* block_tables;         // [num_reqs, block_table_stride]
  int64_t out_token_stride, out_head_stride;
  int64_t query_token_stride, query_head_stride;
  int64_t block_table_stride;
  int num_reqs, num_heads, num_kv_heads, block_size;
  int heads_per_kv;                // num_heads / num_kv_heads (the GQA group)
  int head_chunks;                 // blocks per KV head: ceil(heads_per_kv / MAX_G)
  int num_splits, split_tokens;    // split s covers positions [s * split_tokens, (s + 1) * split_tokens)
  float scale;
};

// Which request owns query row `token`, and how many positions it attends to (its position + 1);
// context_len 0 marks a padding row past the batch.
struct QueryRow {
  int req;
  int context_len;
};

__device__ __forceinline__ QueryRow locate_query_row(const int* query_start_loc, const int* seq_lens, int num_reqs,
                                                     int token) {
  int req;
  if (token < num_reqs && query_start_loc[token] == token && query_start_loc[token + 1] == token + 1) {
    req = token;  // decode: request t computes exactly row t, no search needed
  } else {
    if (token >= query_start_loc[num_reqs]) return {0, 0};
    int lo = 0, hi = num_reqs - 1;  // the last request starting at or before `token` (skips empty ones)
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (query_start_loc[mid] <= token) lo = mid;
      else hi = mid - 1;
    }
    req = lo;
  }
  // Row j of a request with query_len q sits at position seq_len - q + j; j = token - start.
  return {req, seq_lens[req] - query_start_loc[req + 1] + token + 1};
}

template <typename T, int HEAD_SIZE, int MAX_G>
__global__ void __launch_bounds__(kNumThreads) paged_attention_kernel(const Params<T> p) {
  using C = Config<T, HEAD_SIZE, MAX_G>;
  constexpr int kVec = C::kVec, kLanes = C::kLanesPerToken, kVecs = C::kVecsPerLane;

  const int token = blockIdx.x;
  const int kv_head = blockIdx.y / p.head_chunks;
  const int group_offset = (blockIdx.y % p.head_chunks) * MAX_G;
  const int first_head = kv_head * p.heads_per_kv + group_offset;
  const int num_block_heads = min(MAX_G, p.heads_per_kv - group_offset);  // heads this block computes
  const int split = blockIdx.z;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int row_in_load = lane / kLanes;   // which of the warp's kRowsPerLoad rows this lane reads
  const int lane_in_row = lane % kLanes;   // which 16-byte pieces of the row it reads

  const QueryRow row = locate_query_row(p.query_start_loc, p.seq_lens, p.num_reqs, token);
  if (row.context_len <= 0) {  // padding row: zeros, written here only when there is no reduce pass
    if (p.num_splits == 1 && split == 0) {
      for (int i = threadIdx.x; i < num_block_heads * HEAD_SIZE; i += kNumThreads) {
        p.out[token * p.out_token_stride + (first_head + i / HEAD_SIZE) * p.out_head_stride + i % HEAD_SIZE] =
            from_float<T>(0.0f);
      }
    }
    return;
  }
  const int split_start = split * p.split_tokens;
  if (split_start >= row.context_len) return;  // this split lies past the context: the reduce skips it
  const int split_end = min(row.context_len, split_start + p.split_tokens);

  __shared__ __align__(16) float s_scratch[C::kScratchFloats];
  __shared__ int s_slots[kChunkTokens];  // cache slot of each position of the chunk
  __shared__ float s_max[MAX_G], s_sum[MAX_G], s_rescale[MAX_G];
  float(*s_scores)[kChunkTokens] = reinterpret_cast<float(*)[kChunkTokens]>(s_scratch);  // [MAX_G][kChunkTokens]
  if (threadIdx.x < MAX_G) {
    s_max[threadIdx.x] = -FLT_MAX;  // finite, so that exp(old - new) is 0 and never NaN on the first chunk
    s_sum[threadIdx.x] = 0.0f;
    s_rescale[threadIdx.x] = 1.0f;
  }

  // This lane's dimensions of each query head, pre-scaled: q[g][v][e] is dimension
  // (v * kLanes + lane_in_row) * kVec + e of head first_head + g.
  float q[MAX_G][kVecs][kVec];
#pragma unroll
  for (int g = 0; g < MAX_G; ++g) {
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      if (g < num_block_heads) {
        const T* q_ptr = p.query + token * p.query_token_stride + (first_head + g) * p.query_head_stride +
                         (v * kLanes + lane_in_row) * kVec;
        const Packed<T, kVec> packed = load_packed<kVec>(q_ptr);
#pragma unroll
        for (int e = 0; e < kVec; ++e) q[g][v][e] = to_float(packed.elems[e]) * p.scale;
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) q[g][v][e] = 0.0f;
      }
    }
  }

  float acc[MAX_G][kVecs][kVec] = {};  // sum over positions of probability * value, this lane's dimensions
  const int* block_table = p.block_tables + static_cast<int64_t>(row.req) * p.block_table_stride;
  const int64_t slot_stride = static_cast<int64_t>(p.num_kv_heads) * HEAD_SIZE;  // elements per cache slot
  const int64_t head_offset = static_cast<int64_t>(kv_head) * HEAD_SIZE + lane_in_row * kVec;

  for (int chunk_start = split_start; chunk_start < split_end; chunk_start += kChunkTokens) {
    const int chunk_len = min(kChunkTokens, split_end - chunk_start);
    __syncthreads();  // the previous chunk's readers of s_slots and s_scores are done
    for (int i = threadIdx.x; i < chunk_len; i += kNumThreads) {
      const int pos = chunk_start + i;
      s_slots[i] = block_table[pos / p.block_size] * p.block_size + pos % p.block_size;
    }
    __syncthreads();

    // 1. scores[g][i] = q_g . k_(chunk_start + i)
    for (int step = warp * C::kRowsPerWarpStep; step < chunk_len; step += C::kRowsPerStep) {
      Packed<T, kVec> k[kUnroll][kVecs];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {  // issue every load before using any
        const int i = step + u * C::kRowsPerLoad + row_in_load;
        const T* k_ptr = p.key_cache + (i < chunk_len ? s_slots[i] * slot_stride : 0) + head_offset;
#pragma unroll
        for (int v = 0; v < kVecs; ++v) {
          if (i < chunk_len) k[u][v] = load_packed16_ro(k_ptr + v * kLanes * kVec);
          else k[u][v] = Packed<T, kVec>{};
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = step + u * C::kRowsPerLoad + row_in_load;
        float kf[kVecs][kVec];
#pragma unroll
        for (int v = 0; v < kVecs; ++v)
#pragma unroll
          for (int e = 0; e < kVec; ++e) kf[v][e] = to_float(k[u][v].elems[e]);
#pragma unroll
        for (int g = 0; g < MAX_G; ++g) {
          float dot = 0.0f;
#pragma unroll
          for (int v = 0; v < kVecs; ++v)
#pragma unroll
            for (int e = 0; e < kVec; ++e) dot += q[g][v][e] * kf[v][e];
          dot = warp_sum<kLanes>(dot);  // over the lanes sharing this row (xor stays inside the group)
          if (lane_in_row == 0 && i < chunk_len && g < num_block_heads) s_scores[g][i] = dot;
        }
      }
    }
    __syncthreads();

    // 2. online softmax: one warp per head.
    for (int g = warp; g < num_block_heads; g += kNumWarps) {
      float chunk_max = -FLT_MAX;
      for (int i = lane; i < chunk_len; i += 32) chunk_max = fmaxf(chunk_max, s_scores[g][i]);
      const float old_max = s_max[g];
      const float new_max = fmaxf(old_max, warp_max(chunk_max));
      float chunk_sum = 0.0f;
      for (int i = lane; i < chunk_len; i += 32) {
        const float prob = __expf(s_scores[g][i] - new_max);
        s_scores[g][i] = prob;
        chunk_sum += prob;
      }
      chunk_sum = warp_sum(chunk_sum);
      if (lane == 0) {
        const float rescale = __expf(old_max - new_max);  // earlier chunks were weighted against old_max
        s_rescale[g] = rescale;
        s_sum[g] = s_sum[g] * rescale + chunk_sum;
        s_max[g] = new_max;
      }
    }
    __syncthreads();

    // 3. acc = acc * rescale + sum_i prob_i * v_i
#pragma unroll
    for (int g = 0; g < MAX_G; ++g) {
      const float rescale = s_rescale[g];
#pragma unroll
      for (int v = 0; v < kVecs; ++v)
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[g][v][e] *= rescale;
    }
    for (int step = warp * C::kRowsPerWarpStep; step < chunk_len; step += C::kRowsPerStep) {
      Packed<T, kVec> val[kUnroll][kVecs];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = step + u * C::kRowsPerLoad + row_in_load;
        const T* v_ptr = p.value_cache + (i < chunk_len ? s_slots[i] * slot_stride : 0) + head_offset;
#pragma unroll
        for (int v = 0; v < kVecs; ++v) {
          if (i < chunk_len) val[u][v] = load_packed16_ro(v_ptr + v * kLanes * kVec);
          else val[u][v] = Packed<T, kVec>{};
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = step + u * C::kRowsPerLoad + row_in_load;
        if (i >= chunk_len) continue;
#pragma unroll
        for (int g = 0; g < MAX_G; ++g) {
          const float prob = g < num_block_heads ? s_scores[g][i] : 0.0f;
#pragma unroll
          for (int v = 0; v < kVecs; ++v)
#pragma unroll
            for (int e = 0; e < kVec; ++e) acc[g][v][e] += prob * to_float(val[u][v].elems[e]);
        }
      }
    }
  }

  // Combine: the lane groups of a warp hold the same dimensions for different rows.
#pragma unroll
  for (int g = 0; g < MAX_G; ++g)
#pragma unroll
    for (int v = 0; v < kVecs; ++v)
#pragma unroll
      for (int e = 0; e < kVec; ++e)
#pragma unroll
        for (int offset = kLanes; offset < 32; offset *= 2)
          acc[g][v][e] += __shfl_xor_sync(0xffffffffu, acc[g][v][e], offset);

  __syncthreads();  // s_scratch switches from scores to per-warp accumulators [kNumWarps][MAX_G][HEAD_SIZE]
  if (row_in_load == 0) {
#pragma unroll
    for (int g = 0; g < MAX_G; ++g)
#pragma unroll
      for (int v = 0; v < kVecs; ++v)
#pragma unroll
        for (int e = 0; e < kVec; ++e)
          s_scratch[(warp * MAX_G + g) * HEAD_SIZE + (v * kLanes + lane_in_row) * kVec + e] = acc[g][v][e];
  }
  __syncthreads();

  for (int i = threadIdx.x; i < num_block_heads * HEAD_SIZE; i += kNumThreads) {
    const int g = i / HEAD_SIZE, d = i % HEAD_SIZE;
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) total += s_scratch[(w * MAX_G + g) * HEAD_SIZE + d];
    const int head = first_head + g;
    if (p.num_splits == 1) {
      p.out[token * p.out_token_stride + head * p.out_head_stride + d] = from_float<T>(total / s_sum[g]);
    } else {
      const int64_t partial = (static_cast<int64_t>(token) * p.num_heads + head) * p.num_splits + split;
      p.partial_out[partial * HEAD_SIZE + d] = total;
      if (d == 0) {
        p.partial_max[partial] = s_max[g];
        p.partial_sum[partial] = s_sum[g];
      }
    }
  }
}

// out = sum_s w_s * partial_out_s / sum_s w_s * partial_sum_s, with w_s = exp(partial_max_s - max).
template <typename T, int HEAD_SIZE>
__global__ void __launch_bounds__(kNumThreads) paged_attention_reduce_kernel(const Params<T> p) {
  const int token = blockIdx.x, head = blockIdx.y;
  T* out = p.out + token * p.out_token_stride + head * p.out_head_stride;
  const QueryRow row = locate_query_row(p.query_start_loc, p.seq_lens, p.num_reqs, token);
  if (row.context_len <= 0) {
    for (int d = threadIdx.x; d < HEAD_SIZE; d += kNumThreads) out[d] = from_float<T>(0.0f);
    return;
  }
  const int num_valid = (row.context_len + p.split_tokens - 1) / p.split_tokens;  // splits that wrote
  const int64_t base = (static_cast<int64_t>(token) * p.num_heads + head) * p.num_splits;
  float global_max = -FLT_MAX;
  for (int s = 0; s < num_valid; ++s) global_max = fmaxf(global_max, p.partial_max[base + s]);
  float total_sum = 0.0f;
  for (int s = 0; s < num_valid; ++s) total_sum += __expf(p.partial_max[base + s] - global_max) * p.partial_sum[base + s];
  const float inv_sum = 1.0f / total_sum;
  for (int d = threadIdx.x; d < HEAD_SIZE; d += kNumThreads) {
    float total = 0.0f;
    for (int s = 0; s < num_valid; ++s) {
      total += __expf(p.partial_max[base + s] - global_max) * p.partial_out[(base + s) * HEAD_SIZE + d];
    }
    out[d] = from_float<T>(total * inv_sum);
  }
}

// Splits per query: enough thread blocks to give every SM a few to overlap; a batch that already
// fills the GPU is not split (each split costs a partial write and the reduce pass).
int choose_num_splits(int64_t blocks_without_split, int num_chunks) {
  constexpr int kBlocksPerSm = 4;  // 128-thread blocks resident per SM at ~100-130 registers a thread
  const int64_t target = static_cast<int64_t>(num_sms()) * kBlocksPerSm;
  if (blocks_without_split >= target || num_chunks <= 1) return 1;
  return static_cast<int>(std::min<int64_t>(num_chunks, (target + blocks_without_split - 1) / blocks_without_split));
}

template <typename T, int HEAD_SIZE>
void launch_for_head_size(const Params<T>& p, int max_group, dim3 grid, cudaStream_t stream) {
  switch (max_group) {
    case 1: paged_attention_kernel<T, HEAD_SIZE, 1><<<grid, kNumThreads, 0, stream>>>(p); break;
    case 2: paged_attention_kernel<T, HEAD_SIZE, 2><<<grid, kNumThreads, 0, stream>>>(p); break;
    case 4: paged_attention_kernel<T, HEAD_SIZE, 4><<<grid, kNumThreads, 0, stream>>>(p); break;
    default: paged_attention_kernel<T, HEAD_SIZE, 8><<<grid, kNumThreads, 0, stream>>>(p); break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (p.num_splits > 1) {
    paged_attention_reduce_kernel<T, HEAD_SIZE><<<dim3(grid.x, p.num_heads), kNumThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_tables,
                     int64_t max_query_len, int64_t max_seq_len, double scale, int64_t num_splits) {
  TORCH_CHECK(query.is_cuda() && out.is_cuda() && kv_cache.is_cuda() && query_start_loc.is_cuda() &&
                  seq_lens.is_cuda() && block_tables.is_cuda(),
              "paged_attention: tensors must be on the GPU");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "paged_attention: query [num_tokens, num_heads, head_size]");
  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(2) == 1 && out.scalar_type() == query.scalar_type(),
              "paged_attention: out must be like query");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "paged_attention: kv_cache must be contiguous [2, num_blocks, block_size, num_kv_heads, head_size]");
  TORCH_CHECK(kv_cache.scalar_type() == query.scalar_type(), "paged_attention: kv_cache and query must share a dtype");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.scalar_type() == at::kInt,
              "paged_attention: query_start_loc, seq_lens and block_tables must be int32");
  TORCH_CHECK(query_start_loc.is_contiguous() && seq_lens.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.stride(1) == 1,
              "paged_attention: index tensors must be contiguous");
  const int num_tokens = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  const int num_reqs = seq_lens.size(0);
  TORCH_CHECK(kv_cache.size(4) == head_size, "paged_attention: head sizes of query and kv_cache differ");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "paged_attention: num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(head_size == 64 || head_size == 128 || head_size == 256,
              "paged_attention: head_size must be 64, 128 or 256, got ", head_size);
  TORCH_CHECK(query_start_loc.numel() == num_reqs + 1 && block_tables.size(0) >= num_reqs,
              "paged_attention: query_start_loc [num_reqs + 1] and block_tables [num_reqs, ...] expected");
  TORCH_CHECK(max_query_len >= 0 && max_seq_len >= 0, "paged_attention: negative lengths");
  if (num_tokens == 0) return;
  const c10::cuda::OptionalCUDAGuard guard(query.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  const int heads_per_kv = num_heads / num_kv_heads;
  const int max_group = heads_per_kv <= 1 ? 1 : heads_per_kv <= 2 ? 2 : heads_per_kv <= 4 ? 4 : 8;
  const int head_chunks = (heads_per_kv + max_group - 1) / max_group;
  const int num_chunks = std::max<int64_t>(1, (max_seq_len + kChunkTokens - 1) / kChunkTokens);
  int splits = num_splits > 0 ? static_cast<int>(num_splits)
                              : choose_num_splits(static_cast<int64_t>(num_tokens) * num_kv_heads * head_chunks, num_chunks);
  splits = std::clamp(splits, 1, num_chunks);
  // Whole chunks per split. A single split spans any context, whatever max_seq_len says.
  int split_tokens = INT32_MAX / 2;
  if (splits > 1) {
    split_tokens = (num_chunks + splits - 1) / splits * kChunkTokens;
    splits = static_cast<int>((max_seq_len + split_tokens - 1) / split_tokens);
    if (splits == 1) split_tokens = INT32_MAX / 2;
  }

  at::Tensor partial_out, partial_max, partial_sum;
  if (splits > 1) {
    const auto options = query.options().dtype(at::kFloat);
    partial_out = at::empty({num_tokens, num_heads, splits, head_size}, options);
    partial_max = at::empty({num_tokens, num_heads, splits}, options);
    partial_sum = at::empty({num_tokens, num_heads, splits}, options);
  }
  const dim3 grid(num_tokens, num_kv_heads * head_chunks, splits);

  dispatch_float_types(query.scalar_type(), "paged_attention", [&](auto tag) {
    using T = decltype(tag);
    Params<T> p;
    p.out = reinterpret_cast<T*>(out.data_ptr());
    p.query = reinterpret_cast<const T*>(query.data_ptr());
    p.key_cache = reinterpret_cast<const T*>(kv_cache.data_ptr());
    p.value_cache = p.key_cache + kv_cache.numel() / 2;
    p.partial_out = splits > 1 ? partial_out.data_ptr<float>() : nullptr;
    p.partial_max = splits > 1 ? partial_max.data_ptr<float>() : nullptr;
    p.partial_sum = splits > 1 ? partial_sum.data_ptr<float>() : nullptr;
    p.query_start_loc = query_start_loc.data_ptr<int>();
    p.seq_lens = seq_lens.data_ptr<int>();
    p.block_tables = block_tables.data_ptr<int>();
    p.out_token_stride = out.stride(0);
    p.out_head_stride = out.stride(1);
    p.query_token_stride = query.stride(0);
    p.query_head_stride = query.stride(1);
    p.block_table_stride = block_tables.stride(0);
    p.num_reqs = num_reqs;
    p.num_heads = num_heads;
    p.num_kv_heads = num_kv_heads;
    p.block_size = block_size;
    p.heads_per_kv = heads_per_kv;
    p.head_chunks = head_chunks;
    p.num_splits = splits;
    p.split_tokens = split_tokens;
    p.scale = static_cast<float>(scale);
    // 16-byte loads of query rows and cache rows need 16-byte aligned starts.
    constexpr int kVec = kVec16<T>;
    TORCH_CHECK(is_aligned16(p.query) && is_aligned16(p.key_cache) && is_aligned16(p.value_cache) &&
                    p.query_token_stride % kVec == 0 && p.query_head_stride % kVec == 0,
                "paged_attention: query and kv_cache must be 16-byte aligned");
    switch (head_size) {
      case 64: launch_for_head_size<T, 64>(p, max_group, grid, stream); break;
      case 128: launch_for_head_size<T, 128>(p, max_group, grid, stream); break;
      default: launch_for_head_size<T, 256>(p, max_group, grid, stream); break;
    }
  });
}

}  // namespace shoal
