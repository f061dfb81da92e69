"""Group the routing entries of a mixture-of-experts layer by expert, each group padded to a
multiple of `block_size` rows, for a fused-MoE GEMM that gives every block of rows to one
expert; the semantics of the CUDA op `moe_align_block_size`.

topk_ids [num_tokens, topk] names the experts of each token; entry i of its flattening is
(token i // topk, choice i % topk). Outputs:

- sorted_token_ids [max_num_rows] int32: entry indices grouped by expert (expert 0's group
  first), each group followed by padding up to a multiple of block_size; padding and unused
  rows hold num_tokens * topk (an index past every entry). max_num_rows = num_tokens * topk +
  num_experts * (block_size - 1), the most any routing can need.
- expert_ids [cdiv(max_num_rows, block_size)] int32: the expert of each block of rows; -1 for
  blocks past the last group.
- num_tokens_post_padded [1] int32: rows in use, the sum of the padded group sizes.

Within a group the reference orders entries by index; the CUDA op leaves that order arbitrary
(the GEMM does not depend on it). Expert ids outside [0, num_experts) are skipped (experts that
live on another rank). The CUDA op keeps two ints per expert in shared memory: up to
`MAX_CSRC_EXPERTS` experts a rank (DeepSeek-V3's 256 with room to spare; the op itself takes a
few hundred more), refused with a ValueError before the launch; the reference has no limit.
"""

from __future__ import annotations

import torch

from shoal.kernels.dispatch import compiled_op

MAX_CSRC_EXPERTS = 5000


def _output_sizes(num_entries: int, num_experts: int, block_size: int) -> tuple[int, int]:
    max_num_rows = num_entries + num_experts * (block_size - 1)
    return max_num_rows, -(-max_num_rows // block_size)


def moe_align_block_size_ref(
    topk_ids: torch.Tensor, num_experts: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (sorted_token_ids, expert_ids, num_tokens_post_padded), see the module docstring."""
    flat = topk_ids.flatten().to(torch.int64)  # [num_entries]
    num_entries = flat.numel()
    max_num_rows, max_num_blocks = _output_sizes(num_entries, num_experts, block_size)
    device = topk_ids.device

    entries = torch.nonzero((flat >= 0) & (flat < num_experts)).flatten()  # ascending entry index
    experts = flat[entries]
    order = torch.argsort(experts, stable=True)  # group by expert, keeping index order inside
    entries, experts = entries[order], experts[order]
    counts = torch.bincount(experts, minlength=num_experts)  # [num_experts]
    padded = (counts + block_size - 1) // block_size * block_size
    group_start = torch.cumsum(padded, 0) - padded  # first row of each expert's group
    entry_start = torch.cumsum(counts, 0) - counts  # first position of each expert in `entries`
    rank = torch.arange(entries.numel(), device=device) - entry_start[experts]  # place inside the group

    sorted_token_ids = torch.full((max_num_rows,), num_entries, dtype=torch.int32, device=device)
    sorted_token_ids[group_start[experts] + rank] = entries.to(torch.int32)
    blocks_per_expert = padded // block_size
    used = torch.repeat_interleave(torch.arange(num_experts, device=device), blocks_per_expert)
    expert_ids = torch.full((max_num_blocks,), -1, dtype=torch.int32, device=device)
    expert_ids[: used.numel()] = used.to(torch.int32)
    num_tokens_post_padded = padded.sum().reshape(1).to(torch.int32)
    return sorted_token_ids, expert_ids, num_tokens_post_padded


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compiled schema: `moe_align_block_size(topk_ids, num_experts, block_size,
    sorted_token_ids, expert_ids, num_tokens_post_padded) -> ()`."""
    if num_experts < 1 or block_size < 1:
        raise ValueError(
            f"moe_align_block_size: num_experts and block_size must be positive, got {num_experts}, {block_size}"
        )
    op = compiled_op("moe_align_block_size", topk_ids)
    if op is None:
        return moe_align_block_size_ref(topk_ids, num_experts, block_size)
    if num_experts > MAX_CSRC_EXPERTS:
        raise ValueError(
            f"moe_align_block_size: the CUDA op takes up to {MAX_CSRC_EXPERTS} experts a rank, got {num_experts}"
        )
    max_num_rows, max_num_blocks = _output_sizes(topk_ids.numel(), num_experts, block_size)
    device = topk_ids.device
    sorted_token_ids = torch.empty(max_num_rows, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_num_blocks, dtype=torch.int32, device=device)
    num_tokens_post_padded = torch.empty(1, dtype=torch.int32, device=device)
    op(topk_ids, num_experts, block_size, sorted_token_ids, expert_ids, num_tokens_post_padded)
    return sorted_token_ids, expert_ids, num_tokens_post_padded
