"""`StepBuffers`: every named buffer is a fixed view of one allocation, and one load puts each
array in the front rows of its buffer in as few copies as the layout allows."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from shoal.workers.step_buffers import StepBuffers


def make_buffers() -> StepBuffers:
    # 4,096 tokens: each per-token buffer spans 32 KiB, more than the gap a copy bridges.
    return StepBuffers(max_num_tokens=4096, max_num_reqs=8, max_blocks_per_req=6, device=torch.device("cpu"))


def test_buffers_are_disjoint_aligned_views_of_one_allocation() -> None:
    buffers = make_buffers()
    base = buffers.device_bytes.data_ptr()
    spans = []
    for name, tensor in buffers.device_tensors.items():
        start = tensor.data_ptr() - base
        assert start % 64 == 0 and tensor.is_contiguous(), name
        spans.append((start, start + tensor.numel() * tensor.element_size()))
    spans.sort()
    assert all(end <= next_start for (_, end), (next_start, _) in itertools.pairwise(spans))
    assert spans[-1][1] <= buffers.device_bytes.numel()


@pytest.mark.parametrize("merge_gap_bytes, num_copies", [(1, 4), (16 * 1024, 3)])
def test_a_load_fills_the_front_rows_of_each_buffer(merge_gap_bytes: int, num_copies: int, monkeypatch) -> None:
    """On the CPU each array is its own copy; with a GPU's gap, arrays within 16 KiB share one
    (seq_lens and input_ids; slot_mapping and block_tables lie further)."""
    buffers = make_buffers()
    buffers.merge_gap_bytes = merge_gap_bytes
    rng = np.random.default_rng(0)
    addresses = {name: t.data_ptr() for name, t in buffers.device_tensors.items()}
    copies = []
    original_copy = torch.Tensor.copy_
    monkeypatch.setattr(
        torch.Tensor, "copy_", lambda self, src, **kw: copies.append(1) or original_copy(self, src, **kw)
    )
    for step in range(4):
        buffers.begin_step()
        num_tokens, num_reqs, width = rng.integers(1, 64), rng.integers(1, 8), rng.integers(1, 6)
        arrays = {
            "input_ids": rng.integers(0, 1000, num_tokens),
            "slot_mapping": rng.integers(-1, 1000, num_tokens),
            "seq_lens": rng.integers(1, 99, num_reqs).astype(np.int32),
            "block_tables": rng.integers(0, 50, (num_reqs, width)).astype(np.int32),
        }
        copies.clear()
        views = buffers.load(**arrays)
        assert len(copies) == num_copies
        for name, array in arrays.items():
            view = views[name]
            assert view.data_ptr() == addresses[name] and view.shape[0] == len(array)
            got = view[:, :width] if array.ndim == 2 else view
            assert np.array_equal(got.numpy(), array), (step, name)
        assert views["block_tables"].stride() == buffers["block_tables"].stride()  # full rows
