"""`StepBuffers`: the device tensors every step's flat inputs are copied into.

They keep the same addresses from step to step, which CUDA graphs need (a captured graph reads
its inputs from fixed addresses), and on a GPU they are filled from pinned host staging with
asynchronous copies. Reusing the staging is safe because every step ends with a host sync
(reading the sampled tokens), so no copy of the previous step is still in flight.
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
            "block_tables": ((max_num_reqs, max_blocks_per_req), torch.int32),
        }
        self.device_tensors = {
            name: torch.zeros(shape, dtype=dtype, device=device) for name, (shape, dtype) in shapes.items()
        }
        self.host_tensors = {
            name: torch.zeros(shape, dtype=dtype, pin_memory=pin) for name, (shape, dtype) in shapes.items()
        }

    def load(self, **arrays: np.ndarray) -> dict[str, torch.Tensor]:
        """Copy each named array into the front of its buffer; returns the device views
        (rows of `block_tables` keep the full buffer width, so their stride never changes)."""
        views = {}
        for name, array in arrays.items():
            rows = array.shape[0]
            host = self.host_tensors[name][:rows]
            (host[:, : array.shape[1]] if array.ndim == 2 else host).numpy()[:] = array
            views[name] = self.device_tensors[name][:rows]
            views[name].copy_(host, non_blocking=True)
        return views

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.device_tensors[name]
