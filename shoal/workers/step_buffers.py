"""`StepBuffers`: the device tensors every step's flat inputs are copied into.

They keep the same addresses from step to step, which CUDA graphs need (a captured graph reads
its inputs from fixed addresses), and on a GPU they are filled from pinned host staging with
asynchronous copies. With async scheduling the next step's inputs are staged while the
previous step's copies may still be queued on the device, so there are two staging sets used in
turn, and a set is reused only after the copies of two steps ago have run (an event each).
"""

from __future__ import annotations

import numpy as np
import torch


class StepBuffers:
    def __init__(self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int, device: torch.device):
        self.device = device
        pin = device.type == "cuda"
        shapes = {
            "input_ids": ((max_num_tokens,), torch.int64),
            "positions": ((max_num_tokens,), torch.int64),
            "slot_mapping": ((max_num_tokens,), torch.int64),
            "query_start_loc": ((max_num_reqs + 1,), torch.int32),
            "seq_lens": ((max_num_reqs,), torch.int32),
            "decode_order": ((max_num_reqs,), torch.int32),
            "block_tables": ((max_num_reqs, max_blocks_per_req), torch.int32),
            # Async scheduling: rows of input_ids to fill from the previous step's samples.
            "pending_token_index": ((max_num_reqs,), torch.int64),
            "pending_token_rows": ((max_num_reqs,), torch.int64),
        }
        self.device_tensors = {
            name: torch.zeros(shape, dtype=dtype, device=device) for name, (shape, dtype) in shapes.items()
        }
        self.staging = [
            {name: torch.zeros(shape, dtype=dtype, pin_memory=pin) for name, (shape, dtype) in shapes.items()}
            for _ in range(2)
        ]
        self.copies_done = [torch.cuda.Event() for _ in range(2)] if pin else None
        self.current = 0

    def begin_step(self) -> None:
        """Switch to the other staging set, once the copies that last read it have run."""
        if self.copies_done is None:
            return  # CPU: copies are synchronous
        self.copies_done[self.current].record()
        self.current ^= 1
        self.copies_done[self.current].synchronize()

    def load(self, **arrays: np.ndarray) -> dict[str, torch.Tensor]:
        """Copy each named array into the front of its buffer; returns the device views
        (rows of `block_tables` keep the full buffer width, so their stride never changes)."""
        views = {}
        for name, array in arrays.items():
            rows = array.shape[0]
            host = self.staging[self.current][name][:rows]
            (host[:, : array.shape[1]] if array.ndim == 2 else host).numpy()[:] = array
            views[name] = self.device_tensors[name][:rows]
            views[name].copy_(host, non_blocking=True)
        return views

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.device_tensors[name]
