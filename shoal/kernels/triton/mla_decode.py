"""`mla_decode` as a split-K Triton kernel (semantics and reference: shoal/kernels/mla_decode.py),
and `concat_and_cache_mla`, the latent cache write (shoal/kernels/concat_and_cache_mla.py).

Every head of a request attends over the same latents, so one program takes a block of
`BLOCK_H` heads of one request (the rows of its `tl.dot`) and reads each latent tile once for
all of them: the key is the whole latent (`kv_lora_rank` + `qk_rope_head_dim`, two dots: the
compressed part and the rotary part), the value its first `kv_lora_rank` values, the tile
already loaded.

A decode batch has few requests and DeepSeek has few head blocks per rank (V2-Lite: 16 heads,
one block), so the grid would leave most SMs idle on long contexts: each context is split into
`num_splits` parts of `split_tokens` positions, one program each (split-K, as "flash-decoding"),
and a second kernel combines the parts' partial outputs by their log-sum-exp. Splits past a
request's context return at once and are skipped by the combine.

All lengths are read on the device; `max_seq_len` only sizes the split grid (a CUDA graph
captured at the longest context serves every shorter one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shoal.kernels.triton import num_sms

LOG2E = 1.4426950408889634
# Fewer positions than this a split is not worth its partial's write and combine.
MIN_SPLIT_TOKENS = 256
# Programs per SM the split grid aims for, and the most splits of one context.
PROGRAMS_PER_SM = 2
MAX_SPLITS = 32


# The split arguments and the block table's width change with the batch in eager steps (a mixed
# batch's decodes): no specialization on their values, so no variant is first compiled in the
# middle of serving.
@triton.jit(do_not_specialize=["split_tokens", "num_splits", "stride_bt"])
def _mla_decode_kernel(
    out_ptr, partial_out_ptr, partial_lse_ptr, q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr,
    qk_scale, split_tokens, num_splits, num_heads,
    stride_q_req, stride_q_head, stride_o_req, stride_o_head, stride_bt, stride_c_blk, stride_c_tok,
    KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    req = tl.program_id(0)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    start = split * split_tokens
    if start >= seq_len:
        return  # this split lies past the context: the combine skips it
    end = tl.minimum(seq_len, start + split_tokens)
    h_valid = head < num_heads
    offs_c = tl.arange(0, BLOCK_C)
    c_valid = offs_c < KV_LORA_RANK
    offs_r = tl.arange(0, BLOCK_R)
    r_valid = offs_r < ROPE_DIM
    q_rows = q_ptr + req.to(tl.int64) * stride_q_req + head * stride_q_head  # [BLOCK_H]
    q_c = tl.load(q_rows[:, None] + offs_c[None, :], mask=h_valid[:, None] & c_valid[None, :], other=0.0)
    q_r = tl.load(q_rows[:, None] + KV_LORA_RANK + offs_r[None, :], mask=h_valid[:, None] & r_valid[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    block_table = block_tables_ptr + req.to(tl.int64) * stride_bt
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < end
        block = tl.load(block_table + offs_n // BLOCK_SIZE, mask=n_valid, other=0)
        latent = cache_ptr + block.to(tl.int64) * stride_c_blk + (offs_n % BLOCK_SIZE) * stride_c_tok  # [BLOCK_N]
        kv_c = tl.load(latent[:, None] + offs_c[None, :], mask=n_valid[:, None] & c_valid[None, :], other=0.0)
        k_r = tl.load(
            latent[:, None] + KV_LORA_RANK + offs_r[None, :], mask=n_valid[:, None] & r_valid[None, :], other=0.0
        )
        s = tl.dot(q_c, tl.trans(kv_c), input_precision=DOT_PRECISION)
        s = tl.dot(q_r, tl.trans(k_r), s, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N], log2 units
        s = tl.where(n_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv_c.dtype), kv_c, input_precision=DOT_PRECISION)
        m_i = m_new

    if SPLIT:
        partial = (req * num_heads + head) * num_splits + split  # [BLOCK_H]
        out = acc / l_i[:, None]
        tl.store(partial_out_ptr + partial[:, None] * BLOCK_C + offs_c[None, :], out, mask=h_valid[:, None])
        tl.store(partial_lse_ptr + partial, m_i + tl.log2(l_i), mask=h_valid)
    else:
        out_rows = out_ptr + req.to(tl.int64) * stride_o_req + head * stride_o_head
        out = acc / l_i[:, None]
        tl.store(out_rows[:, None] + offs_c[None, :], out, mask=h_valid[:, None] & c_valid[None, :])


@triton.jit(do_not_specialize=["split_tokens", "num_splits"])
def _mla_combine_kernel(
    out_ptr, partial_out_ptr, partial_lse_ptr, seq_lens_ptr, split_tokens, num_splits, num_heads,
    stride_o_req, stride_o_head,
    KV_LORA_RANK: tl.constexpr, BLOCK_C: tl.constexpr, SPLITS_PAD: tl.constexpr,
):  # fmt: skip
    """out = sum_s 2^(lse_s - lse) out_s over the splits that ran, lse = log2 sum_s 2^lse_s."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + req)
    num_valid = (seq_len + split_tokens - 1) // split_tokens
    offs_s = tl.arange(0, SPLITS_PAD)
    s_valid = offs_s < num_valid
    partial = (req * num_heads + head) * num_splits + offs_s  # [SPLITS_PAD]
    lse = tl.load(partial_lse_ptr + partial, mask=s_valid, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # 0 for splits that did not run
    w = w / tl.sum(w, 0)
    offs_c = tl.arange(0, BLOCK_C)
    parts = tl.load(partial_out_ptr + partial[:, None] * BLOCK_C + offs_c[None, :], mask=s_valid[:, None], other=0.0)
    out = tl.sum(parts * w[:, None], 0)  # [BLOCK_C]
    out_row = out_ptr + req.to(tl.int64) * stride_o_req + head * stride_o_head
    tl.store(out_row + offs_c, out, mask=offs_c < KV_LORA_RANK)


def choose_num_splits(num_programs: int, max_seq_len: int, device: torch.device) -> int:
    """Split only a grid too small to fill the GPU, into parts of at least MIN_SPLIT_TOKENS."""
    max_splits = min(MAX_SPLITS, triton.cdiv(max(max_seq_len, 1), MIN_SPLIT_TOKENS))
    wanted = triton.cdiv(PROGRAMS_PER_SM * num_sms(device), num_programs)
    return max(1, min(max_splits, wanted))


@dataclass(frozen=True)
class MLADecodeLaunch:
    """Tile sizes and warps of the decode kernel (benchmarks/bench_mla_decode.py sweeps them)."""

    block_h: int  # heads a program: the rows of its tl.dot, at least 16
    block_n: int = 32  # latents a tile
    num_warps: int = 4
    num_stages: int = 2


def default_launch(num_heads: int) -> MLADecodeLaunch:
    """Every head block reads the latents again, so as many heads a program as the registers
    allow (one H200, 256 requests of 768 tokens, 128 heads: 374 us with 64 heads and 8 warps, 435
    with 32, 604 with 16), and tiles of 32 latents (16 heads: 93 us against 149 us with 16; a
    sweep of 16-64 latents, 4-8 warps, 1-3 stages)."""
    block_h = min(64, max(16, triton.next_power_of_2(num_heads)))
    return MLADecodeLaunch(block_h, num_warps=8 if block_h == 64 else 4)


def triton_mla_decode(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    num_splits: int = 0,
    launch: MLADecodeLaunch | None = None,
) -> None:
    """out [R, H, kv_lora_rank]; query [R, H, kv_lora_rank + rope] (unit last stride); kv_cache
    [1, num_blocks, block_size, 1, latent]; num_splits 0: chosen from the grid and max_seq_len;
    `launch` overrides `default_launch` (the benchmark's sweep)."""
    num_reqs, num_heads, latent_size = query.shape
    kv_lora_rank = out.shape[-1]
    rope_dim = latent_size - kv_lora_rank
    cache = kv_cache[0, :, :, 0]  # [num_blocks, block_size, latent]
    launch = launch or default_launch(num_heads)
    block_h, block_n = launch.block_h, launch.block_n
    num_head_blocks = triton.cdiv(num_heads, block_h)
    block_c = triton.next_power_of_2(kv_lora_rank)
    if num_splits <= 0:
        num_splits = choose_num_splits(num_reqs * num_head_blocks, max_seq_len, query.device)
    split_tokens = triton.cdiv(triton.cdiv(max(max_seq_len, 1), num_splits), block_n) * block_n
    num_splits = triton.cdiv(max(max_seq_len, 1), split_tokens)
    if num_splits == 1:
        split_tokens = 2**30  # one split covers any context, whatever max_seq_len says
    partial_out = partial_lse = query.new_empty(0, dtype=torch.float32)
    if num_splits > 1:
        partial_out = query.new_empty(num_reqs, num_heads, num_splits, block_c, dtype=torch.float32)
        partial_lse = query.new_empty(num_reqs, num_heads, num_splits, dtype=torch.float32)
    _mla_decode_kernel[(num_reqs, num_head_blocks, num_splits)](
        out, partial_out, partial_lse, query, cache, block_tables, seq_lens,
        scale * LOG2E, split_tokens, num_splits, num_heads,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        cache.stride(0), cache.stride(1),
        KV_LORA_RANK=kv_lora_rank, ROPE_DIM=rope_dim, BLOCK_C=block_c,
        BLOCK_R=max(16, triton.next_power_of_2(rope_dim)), BLOCK_SIZE=cache.shape[1], BLOCK_H=block_h,
        BLOCK_N=block_n, SPLIT=num_splits > 1, DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _mla_combine_kernel[(num_reqs, num_heads)](
            out, partial_out, partial_lse, seq_lens, split_tokens, num_splits, num_heads,
            out.stride(0), out.stride(1),
            KV_LORA_RANK=kv_lora_rank, BLOCK_C=block_c, SPLITS_PAD=triton.next_power_of_2(num_splits),
        )  # fmt: skip


def warm_up_triton_mla_decode(kv_cache: torch.Tensor, num_heads: int, kv_lora_rank: int, dtype: torch.dtype) -> None:
    """Compile every variant a step can launch: one without splits and one per padded split
    count (the combine's SPLITS_PAD), so that no eager step (a mixed batch's decodes, whose
    contexts vary) compiles one in the middle of a run. One request of one token, reading
    position 0 of block 0, at the context lengths that give each split count."""
    device, latent_size = kv_cache.device, kv_cache.shape[-1]
    query = torch.zeros(1, num_heads, latent_size, device=device, dtype=dtype)
    out = query.new_empty(1, num_heads, kv_lora_rank)
    seq_lens = torch.ones(1, device=device, dtype=torch.int32)
    num_splits = 1
    while num_splits <= MAX_SPLITS:
        max_seq_len = num_splits * MIN_SPLIT_TOKENS
        block_tables = torch.zeros(1, triton.cdiv(max_seq_len, kv_cache.shape[2]), device=device, dtype=torch.int32)
        triton_mla_decode(out, query, kv_cache, block_tables, seq_lens, max_seq_len, 1.0, num_splits)
        num_splits *= 2


@triton.jit
def _concat_and_cache_mla_kernel(
    kv_c_ptr, k_pe_ptr, cache_ptr, slot_mapping_ptr, stride_kv_c, stride_k_pe, stride_c_blk, stride_c_tok,
    KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # padding
    row = cache_ptr + (slot // BLOCK_SIZE) * stride_c_blk + (slot % BLOCK_SIZE) * stride_c_tok
    offs_c = tl.arange(0, BLOCK_C)
    c_valid = offs_c < KV_LORA_RANK
    kv_c = tl.load(kv_c_ptr + token * stride_kv_c + offs_c, mask=c_valid)
    tl.store(row + offs_c, kv_c.to(cache_ptr.dtype.element_ty), mask=c_valid)
    offs_r = tl.arange(0, BLOCK_R)
    r_valid = offs_r < ROPE_DIM
    k_pe = tl.load(k_pe_ptr + token * stride_k_pe + offs_r, mask=r_valid)
    tl.store(row + KV_LORA_RANK + offs_r, k_pe.to(cache_ptr.dtype.element_ty), mask=r_valid)


def triton_concat_and_cache_mla(
    kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """kv_c [T, kv_lora_rank], k_pe [T, rope] (unit last stride, any row stride) -> their slots."""
    num_tokens, kv_lora_rank = kv_c.shape
    if num_tokens == 0:
        return
    rope_dim = k_pe.shape[-1]
    cache = kv_cache[0, :, :, 0]  # [num_blocks, block_size, latent]
    _concat_and_cache_mla_kernel[(num_tokens,)](
        kv_c, k_pe, cache, slot_mapping, kv_c.stride(0), k_pe.stride(0), cache.stride(0), cache.stride(1),
        KV_LORA_RANK=kv_lora_rank, ROPE_DIM=rope_dim, BLOCK_SIZE=cache.shape[1],
        BLOCK_C=triton.next_power_of_2(kv_lora_rank), BLOCK_R=triton.next_power_of_2(rope_dim),
    )  # fmt: skip
