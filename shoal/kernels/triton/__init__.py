"""Triton kernels, registered with the dispatcher (shoal/kernels/dispatch.py) when triton imports.

Triton is not a dependency of shoal: GPU machines bring it with their torch, CPU machines need
none of this (a kernel can still be debugged there under TRITON_INTERPRET=1 on CPU tensors).

Integer arguments that change from step to step in eagerly launched kernels (request counts,
seeds, chunk sizes) are listed in each kernel's `do_not_specialize`: Triton otherwise compiles
one variant per class of value (1, multiples of 16, the rest), and a variant first met in the
middle of serving stalls every running request while it compiles. (The decode kernel's split
arguments stay specialized: they are fixed per captured graph, and take two classes eagerly.)
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch

logger = logging.getLogger(__name__)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def num_sms(device: torch.device, on_cpu: int = 132) -> int:
    """SMs of a CUDA device, which launch heuristics size grids by (a host query, no sync);
    `on_cpu` stands in for the interpreter's CPU tensors."""
    if device.type != "cuda":
        return on_cpu
    return torch.cuda.get_device_properties(device).multi_processor_count


def register_triton_kernels() -> bool:
    """Register every Triton kernel with the dispatcher; False when triton is not installed."""
    if not triton_available():
        logger.debug("triton is not installed: no Triton kernels")
        return False
    from shoal.kernels.dispatch import register_kernel
    from shoal.kernels.triton.batch_invariant import triton_bi_matmul, triton_bi_paged_attention, triton_bi_rms_norm
    from shoal.kernels.triton.fused_moe import triton_fused_moe
    from shoal.kernels.triton.fused_moe_block_fp8 import triton_fused_moe_block_fp8
    from shoal.kernels.triton.fused_moe_lora import triton_fused_moe_lora
    from shoal.kernels.triton.gemv import triton_gemv
    from shoal.kernels.triton.lora_segments import triton_lora_expand_segments, triton_lora_shrink_segments
    from shoal.kernels.triton.mla_decode import triton_concat_and_cache_mla, triton_mla_decode
    from shoal.kernels.triton.paged_attention import triton_paged_attention
    from shoal.kernels.triton.per_token_group_quant_fp8 import triton_per_token_group_quant_fp8
    from shoal.kernels.triton.rope_and_cache import triton_rope_and_cache
    from shoal.kernels.triton.sampling import triton_gumbel_sample
    from shoal.kernels.triton.softmax_topk import triton_softmax_topk
    from shoal.kernels.triton.w8a8_block_fp8_matmul import triton_w8a8_block_fp8_matmul

    register_kernel("paged_attention", triton_paged_attention)
    register_kernel("gumbel_sample", triton_gumbel_sample)
    register_kernel("gemv", triton_gemv)
    register_kernel("rope_and_cache", triton_rope_and_cache)
    register_kernel("fused_moe", triton_fused_moe)
    register_kernel("mla_decode", triton_mla_decode)
    register_kernel("concat_and_cache_mla", triton_concat_and_cache_mla)
    register_kernel("per_token_group_quant_fp8", triton_per_token_group_quant_fp8)
    register_kernel("softmax_topk", triton_softmax_topk)
    register_kernel("w8a8_block_fp8_matmul", triton_w8a8_block_fp8_matmul)
    register_kernel("fused_moe_block_fp8", triton_fused_moe_block_fp8)
    register_kernel("lora_shrink_segments", triton_lora_shrink_segments)
    register_kernel("lora_expand_segments", triton_lora_expand_segments)
    register_kernel("fused_moe_lora", triton_fused_moe_lora)
    register_kernel("bi_matmul", triton_bi_matmul)
    register_kernel("bi_rms_norm", triton_bi_rms_norm)
    register_kernel("bi_paged_attention", triton_bi_paged_attention)
    return True
