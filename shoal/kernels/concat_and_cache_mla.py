"""Write this step's latents into the paged MLA cache: token t's `[kv_c_t, k_pe_t]`
(`kv_lora_rank` normalized values, then `qk_rope_head_dim` rotated key values) goes to slot
`slot_mapping[t]` of `kv_cache` [1, num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim],
i.e. block `slot // block_size`, offset `slot % block_size`. A slot of -1 (padding) is not written.
"""

from __future__ import annotations

import torch

from shoal.kernels.dispatch import registered_kernel


def concat_and_cache_mla_ref(
    kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """kv_c [num_tokens, kv_lora_rank], k_pe [num_tokens, qk_rope_head_dim] (any row stride)."""
    slots_view = kv_cache.view(-1, kv_cache.shape[-1])  # [num_slots, latent_size]
    latent = torch.cat((kv_c, k_pe), dim=-1).to(kv_cache.dtype)  # [num_tokens, latent_size]
    slots = slot_mapping.to(torch.int64)
    if bool((slots < 0).any()):
        keep = slots >= 0
        latent, slots = latent[keep], slots[keep]
    slots_view.index_copy_(0, slots, latent)


def concat_and_cache_mla(
    kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """On CUDA the Triton kernel (no host sync, so decode graphs capture it)."""
    op = registered_kernel("concat_and_cache_mla", kv_c)
    if op is None:
        concat_and_cache_mla_ref(kv_c, k_pe, kv_cache, slot_mapping)
    else:
        op(kv_c, k_pe, kv_cache, slot_mapping)
