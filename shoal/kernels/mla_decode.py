"""Decode attention of multi-head latent attention over the paged latent cache (DeepSeek-AI,
2024, "DeepSeek-V2", section 2.1.3: the up-projections absorbed into the query and the output).

Each request has one new token. Its query has been folded into the latent space: for head h,
`q_h = [W_UK_h^T q_nope_h, q_pe_h]`, `kv_lora_rank + qk_rope_head_dim` values, the width of a
cached latent `[c_kv, k_pe]`. Then all heads attend over the same latents:

    score_h,t = q_h . latent_t * scale,   out_h = sum_t softmax_t(score_h) * c_kv_t

`out` stays in the latent space (`kv_lora_rank` values per head); the caller applies W_UV.
The context of request i is the first `seq_lens[i]` positions of its blocks (`block_tables[i]`),
already including this step's latent.

`kv_cache` is `[1, num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]`
(shoal/layers/kv_cache_spec.py `mla_spec`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shoal.kernels.dispatch import registered_kernel


def mla_decode_ref(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
) -> None:
    """out [num_reqs, num_heads, kv_lora_rank]; query [num_reqs, num_heads, latent_size]; the
    contexts padded to `max_seq_len` (at least the longest) and masked past each end."""
    kv_lora_rank = out.shape[-1]
    block_size = kv_cache.shape[2]
    num_blocks = -(-max_seq_len // block_size)
    latents = kv_cache[0, :, :, 0]  # [num_blocks_total, block_size, latent_size]
    context = latents[block_tables[:, :num_blocks].to(torch.int64)].flatten(1, 2)  # [R, L, latent_size]
    context = context.to(query.dtype)
    positions = torch.arange(context.shape[1], device=query.device)
    mask = (positions[None, :] < seq_lens[:, None].to(positions.dtype))[:, None, None, :]  # [R, 1, 1, L]
    # The heads are the query rows of one shared "head": [R, 1, num_heads, latent_size].
    attn = F.scaled_dot_product_attention(
        query.unsqueeze(1), context.unsqueeze(1), context[..., :kv_lora_rank].unsqueeze(1), attn_mask=mask, scale=scale
    )  # [R, 1, num_heads, kv_lora_rank]
    out.copy_(attn.squeeze(1))


def mla_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    kv_lora_rank: int,
    scale: float,
) -> torch.Tensor:
    """-> [num_reqs, num_heads, kv_lora_rank]. Compiled call: `mla_decode(out, query, kv_cache,
    block_tables, seq_lens, max_seq_len, scale)` (the Triton split-K kernel,
    shoal/kernels/triton/mla_decode.py); every argument is on the device, so a decode CUDA
    graph replays it with new lengths (`max_seq_len` only bounds the grid)."""
    out = query.new_empty(*query.shape[:-1], kv_lora_rank)
    op = registered_kernel("mla_decode", query)
    if op is None:
        mla_decode_ref(out, query, kv_cache, block_tables, seq_lens, max_seq_len, scale)
    else:
        op(out, query, kv_cache, block_tables, seq_lens, max_seq_len, scale)
    return out


_WARMED_UP: set[tuple] = set()


def warm_up_mla_decode(kv_cache: torch.Tensor, num_heads: int, kv_lora_rank: int, dtype: torch.dtype) -> None:
    """On the GPU, compile every variant of the registered kernel before serving (see
    `warm_up_triton_mla_decode`); nothing without one, or when a layer of the same shape was
    warmed up already in this process (variants compile per shape, not per layer)."""
    if registered_kernel("mla_decode", kv_cache) is None:
        return
    key = (tuple(kv_cache.shape[2:]), kv_cache.dtype, kv_cache.device, num_heads, kv_lora_rank, dtype)
    if key in _WARMED_UP:
        return
    _WARMED_UP.add(key)
    from shoal.kernels.triton.mla_decode import warm_up_triton_mla_decode

    warm_up_triton_mla_decode(kv_cache, num_heads, kv_lora_rank, dtype)
