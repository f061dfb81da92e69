"""`fused_moe_block_fp8`: `fused_moe` (shoal/kernels/fused_moe.py) with block-wise fp8 experts,
DeepSeek-V3's W8A8 (shoal/layers/quantization/fp8_block.py):

- w13 [num_experts, 2I, hidden] and w2 [num_experts, hidden, I] in float8_e4m3fn, with block
  scales w13_scale_inv [num_experts, 2I / block_n, ceil(hidden / block_k)] and w2_scale_inv
  [num_experts, ceil(hidden / block_n), ceil(I / block_k)];
- the input of each GEMM quantized per token and group of block_k at run time: the tokens'
  hidden states before gate_up, each entry's silu(gate) * up before down.

`fused_moe_block_fp8_ref` rounds the activations exactly so (quantize, dequantize) and runs
`fused_moe_ref` in float32 on the dequantized weights. On CUDA the registered Triton kernels
(shoal/kernels/triton/fused_moe_block_fp8.py) multiply the fp8 values and scale each group's
product in the K loop.
"""

from __future__ import annotations

import torch

from shoal.kernels.dispatch import registered_kernel
from shoal.kernels.fused_moe import fused_moe_ref
from shoal.kernels.per_token_group_quant_fp8 import dequantize_per_token_group, per_token_group_quant_fp8_ref
from shoal.kernels.w8a8_block_fp8_matmul import dequantize_block_fp8


def fake_quant_per_token_group(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """x rounded as per_token_group_quant_fp8 rounds it, as float32."""
    return dequantize_per_token_group(*per_token_group_quant_fp8_ref(x, group_size), group_size)


def fused_moe_block_fp8_ref(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    block_size: tuple[int, int],
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """-> [num_tokens, hidden] in hidden_states' dtype (see the module docstring)."""
    group_size = block_size[1]
    out = fused_moe_ref(
        fake_quant_per_token_group(hidden_states, group_size),
        dequantize_block_fp8(w13, w13_scale_inv, block_size),
        dequantize_block_fp8(w2, w2_scale_inv, block_size),
        topk_weights,
        topk_ids,
        expert_map,
        intermediate_quant=lambda activated: fake_quant_per_token_group(activated, group_size),
    )
    return out.to(hidden_states.dtype)


def fused_moe_block_fp8(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    block_size: tuple[int, int],
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton kernels on CUDA (registered as "fused_moe_block_fp8"), the reference elsewhere."""
    kernel = registered_kernel("fused_moe_block_fp8", hidden_states)
    args = (hidden_states, w13, w2, w13_scale_inv, w2_scale_inv, topk_weights, topk_ids, block_size, expert_map)
    if kernel is None:
        return fused_moe_block_fp8_ref(*args)
    return kernel(*args)  # type: ignore[return-value]


_WARMED_UP: set[tuple] = set()


def warm_up_fused_moe_block_fp8(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    block_size: tuple[int, int],
    top_k: int,
    max_num_tokens: int,
    dtype: torch.dtype,
    expert_map: torch.Tensor | None = None,
) -> list[int]:
    """`warm_up_fused_moe` for the block-fp8 kernels: one call per launch a batch of up to
    `max_num_tokens` tokens of `dtype` activations can pick; returns the batch sizes run."""
    kernel = registered_kernel("fused_moe_block_fp8", w13)
    if kernel is None:
        return []
    from shoal.kernels.triton.fused_moe_config import device_name, dtype_name, launch_table, warm_up_token_counts

    num_experts, intermediate2, hidden = w13.shape
    key = (
        tuple(w13.shape),
        tuple(w2.shape),
        block_size,
        dtype,
        w13.device,
        top_k,
        max_num_tokens,
        expert_map is not None,
    )
    if key in _WARMED_UP:
        return []
    _WARMED_UP.add(key)
    table = launch_table(num_experts, intermediate2 // 2, dtype_name(w13.dtype), device_name(w13.device))
    num_global_experts = num_experts if expert_map is None else expert_map.numel()
    counts = warm_up_token_counts(table, max_num_tokens)
    for num_tokens in counts:
        hidden_states = torch.zeros(num_tokens, hidden, dtype=dtype, device=w13.device)
        topk_ids = torch.arange(num_tokens * top_k, device=w13.device).remainder(num_global_experts)
        topk_weights = torch.ones(num_tokens, top_k, dtype=torch.float32, device=w13.device)
        kernel(hidden_states, w13, w2, w13_scale_inv, w2_scale_inv, topk_weights,
               topk_ids.view(num_tokens, top_k), block_size, expert_map)  # fmt: skip
    return counts
