"""`StepBuffers`: the device tensors every step's flat inputs are copied into.

They keep the same addresses from step to step, which CUDA graphs need (a captured graph reads
its inputs from fixed addresses), and on a GPU they are filled from pinned host staging with
asynchronous copies. With async scheduling the next step's inputs are staged while the
previous step's copies may still be queued on the device, so there are two staging sets used in
turn, and a set is reused only after the copies of two steps ago have run (an event each).

All buffers are views into one device allocation, and each staging set is one pinned
allocation laid out the same way, so one `load` can copy several arrays at once. On a GPU each
copy costs the host ~10-20 µs (torch's dispatch and `cudaMemcpyAsync`) and a step loads up to
eleven arrays, so arrays that lie close together go in one copy: a decode step of a full batch
is four copies (five for smaller batches), a full prefill step one or two.
"""

from __future__ import annotations

import math

import numpy as np
import torch

# Each buffer starts at a multiple of this many bytes (any dtype's alignment, a cache line).
_ALIGN_BYTES = 64
# On a GPU, loaded arrays closer than this go in one copy, the bytes between them too: copying
# 16 KiB more costs the copy engine well under what another copy costs the host. On the CPU a
# copy costs its bytes, so only touching arrays share one.
_GPU_MERGE_GAP_BYTES = 16 * 1024


class StepBuffers:
    def __init__(self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int, device: torch.device):
        self.device = device
        pin = device.type == "cuda"
        # In layout order: per request (a decode step loads them all, mostly front rows), per
        # token, the block tables, and what async scheduling needs.
        shapes = {
            "query_start_loc": ((max_num_reqs + 1,), torch.int32),
            "seq_lens": ((max_num_reqs,), torch.int32),
            "decode_order": ((max_num_reqs,), torch.int32),
            # A plain batch's sampling metadata, per sampling row (sampler.temperatures_only).
            "sampling_temperature": ((max_num_reqs,), torch.float32),
            "sampling_greedy": ((max_num_reqs,), torch.bool),
            "input_ids": ((max_num_tokens,), torch.int64),
            "positions": ((max_num_tokens,), torch.int64),
            "slot_mapping": ((max_num_tokens,), torch.int64),
            "block_tables": ((max_num_reqs, max_blocks_per_req), torch.int32),
            # Async scheduling: rows of input_ids to fill from the previous step's samples.
            "pending_token_index": ((max_num_reqs,), torch.int64),
            "pending_token_rows": ((max_num_reqs,), torch.int64),
        }
        self.offsets: dict[str, int] = {}
        num_bytes = 0
        for name, (shape, dtype) in shapes.items():
            self.offsets[name] = num_bytes
            num_bytes += -(-math.prod(shape) * dtype.itemsize // _ALIGN_BYTES) * _ALIGN_BYTES
        self.device_bytes = torch.zeros(num_bytes, dtype=torch.uint8, device=device)
        self.staging_bytes = [torch.zeros(num_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self.device_tensors = _views(self.device_bytes, self.offsets, shapes)
        # The staging sets as numpy arrays: a numpy slice costs a fraction of a torch one.
        self.staging = [
            {name: view.numpy() for name, view in _views(staging, self.offsets, shapes).items()}
            for staging in self.staging_bytes
        ]
        self.copies_done = [torch.cuda.Event() for _ in range(2)] if pin else None
        self.merge_gap_bytes = _GPU_MERGE_GAP_BYTES if pin else 1
        self.current = 0

    def begin_step(self) -> None:
        """Switch to the other staging set, once the copies that last read it have run."""
        if self.copies_done is None:
            return  # CPU: copies are synchronous
        self.copies_done[self.current].record()
        self.current ^= 1
        self.copies_done[self.current].synchronize()

    def load(self, **arrays: np.ndarray) -> dict[str, torch.Tensor]:
        """Copy each named array into the front of its buffer (a 2-D array into the front
        columns of its rows); returns the device views of the rows loaded (rows of
        `block_tables` keep the full buffer width, so their stride never changes).

        A copy that joins two arrays also copies the bytes between them (rows of a buffer past
        what this call loads), which take whatever this staging set held: readers see only the
        rows each step loads (a CUDA-graph replay's padding rows are loaded with the step's own)."""
        staging = self.staging[self.current]
        views = {}
        spans = []
        for name, array in arrays.items():
            rows = array.shape[0]
            host = staging[name]
            if array.ndim == 2:
                host[:rows, : array.shape[1]] = array
            else:
                host[:rows] = array
            views[name] = self.device_tensors[name][:rows]
            spans.append((self.offsets[name], self.offsets[name] + rows * host.strides[0]))
        for start, end in _merged(spans, self.merge_gap_bytes):
            self.device_bytes[start:end].copy_(self.staging_bytes[self.current][start:end], non_blocking=True)
        return views

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.device_tensors[name]


def _views(
    buffer: torch.Tensor, offsets: dict[str, int], shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
) -> dict[str, torch.Tensor]:
    """Each named tensor as a view of its bytes in `buffer`."""
    views = {}
    for name, (shape, dtype) in shapes.items():
        num_bytes = math.prod(shape) * dtype.itemsize
        views[name] = buffer[offsets[name] : offsets[name] + num_bytes].view(dtype).view(shape)
    return views


def _merged(spans: list[tuple[int, int]], gap_bytes: int) -> list[tuple[int, int]]:
    """The byte ranges to copy: the spans in order, those less than `gap_bytes` apart joined
    (empty spans dropped)."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if merged and start - merged[-1][1] < gap_bytes:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
