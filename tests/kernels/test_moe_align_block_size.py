from __future__ import annotations

import pytest
import torch

from shoal.kernels.moe_align_block_size import moe_align_block_size, moe_align_block_size_ref
from tests.kernels.csrc_utils import csrc_op


def test_small_example_by_hand():
    topk_ids = torch.tensor([[0, 2], [2, 1], [0, 0], [3, 2]])  # entries 0..7
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, num_experts=4, block_size=4)
    pad = 8
    assert sorted_ids.tolist()[:16] == [0, 4, 5, pad, 3, pad, pad, pad, 1, 2, 7, pad, 6, pad, pad, pad]
    assert sorted_ids.numel() == 8 + 4 * 3 and bool((sorted_ids[16:] == pad).all())
    assert expert_ids.tolist() == [0, 1, 2, 3, -1]
    assert num_post.tolist() == [16]


@pytest.mark.parametrize(
    "num_tokens,topk,num_experts,block_size", [(1, 1, 4, 16), (37, 2, 8, 4), (200, 8, 64, 16), (90, 8, 1500, 16)]
)
def test_every_entry_lands_once_in_its_experts_blocks(num_tokens, topk, num_experts, block_size):
    topk_ids = torch.randint(0, num_experts, (num_tokens, topk))
    topk_ids[0, 0] = -1  # an expert on another rank: skipped
    sorted_ids, expert_ids, num_post = moe_align_block_size_ref(topk_ids, num_experts, block_size)
    num_entries = topk_ids.numel()
    rows = int(num_post)
    assert rows % block_size == 0
    flat = topk_ids.flatten()
    placed = sorted_ids[:rows]
    real = placed[placed < num_entries]
    assert sorted(real.tolist()) == [i for i in range(num_entries) if flat[i] >= 0]
    for row, entry in enumerate(placed.tolist()):
        if entry < num_entries:
            assert flat[entry] == expert_ids[row // block_size]
    assert bool((expert_ids[rows // block_size :] == -1).all())


def _canonical(sorted_ids: torch.Tensor, expert_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """Sort each expert's group of rows: the CUDA op orders entries inside a group arbitrarily."""
    ids = sorted_ids.cpu().clone()
    for expert in expert_ids.unique().tolist():
        if expert < 0:
            continue
        blocks = torch.nonzero(expert_ids.cpu() == expert).flatten()
        rows = slice(int(blocks.min()) * block_size, (int(blocks.max()) + 1) * block_size)
        ids[rows] = ids[rows].sort().values
    return ids


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,topk", [(1, 1), (17, 2), (256, 8), (4096, 8)])
@pytest.mark.parametrize("num_experts,block_size", [(8, 16), (64, 64), (256, 16), (512, 64), (2048, 16)])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_moe_align_block_size_csrc_matches_reference(num_tokens, topk, num_experts, block_size, id_dtype):
    topk_ids = torch.randint(0, num_experts, (num_tokens, topk), device="cuda", dtype=id_dtype)
    topk_ids[0, 0] = -1
    expected = moe_align_block_size_ref(topk_ids, num_experts, block_size)
    outputs = (
        torch.empty_like(expected[0]),
        torch.empty_like(expected[1]),
        torch.empty_like(expected[2]),
    )
    csrc_op("moe_align_block_size")(topk_ids, num_experts, block_size, *outputs)
    sorted_ids, expert_ids, num_post = outputs
    assert torch.equal(num_post, expected[2])
    assert torch.equal(expert_ids, expected[1])
    assert torch.equal(_canonical(sorted_ids, expert_ids, block_size), _canonical(expected[0], expected[1], block_size))


@pytest.mark.gpu
def test_moe_align_block_size_refuses_more_experts_than_the_csrc_op_holds():
    """A ValueError before the launch (the op's own check is the last guard)."""
    from shoal.kernels.moe_align_block_size import MAX_CSRC_EXPERTS, moe_align_block_size

    topk_ids = torch.zeros(4, 2, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=f"up to {MAX_CSRC_EXPERTS} experts a rank, got 9000"):
        moe_align_block_size(topk_ids, 9000, 16)
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, MAX_CSRC_EXPERTS, 16)  # the largest it takes
    assert num_post.item() == 16 and expert_ids[0].item() == 0
    assert sorted(sorted_ids[:8].tolist()) == list(range(8)) and sorted_ids[8:16].tolist() == [8] * 8
