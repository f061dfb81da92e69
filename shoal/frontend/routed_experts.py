"""One completion's routed experts, gathered from the engine's outputs into one array
[num_positions, num_layers, top_k] int32 (`CompletionOutput.routed_experts`).

Each output brings the positions computed since the last (`RoutedExperts`). A request
recomputed from an earlier position (after a preemption, or a pause that dropped its KV cache)
sends those positions again: they replace what was there, so the array always holds one row per
position, prompt first, the last token (never run through the model) excluded.
"""

from __future__ import annotations

import numpy as np

from shoal.step import RoutedExperts


class RoutedExpertsBuffer:
    __slots__ = ("ids", "num_positions")

    def __init__(self) -> None:
        self.ids: np.ndarray | None = None  # [capacity, num_layers, top_k] int32
        self.num_positions = 0

    def write(self, chunk: RoutedExperts) -> None:
        rows = np.frombuffer(chunk.expert_ids, dtype=np.int32).reshape(-1, chunk.num_layers, chunk.top_k)
        end = chunk.start + len(rows)
        if self.ids is None or end > len(self.ids):
            capacity = max(end, 2 * (len(self.ids) if self.ids is not None else 0), 64)
            grown = np.full((capacity, chunk.num_layers, chunk.top_k), -1, dtype=np.int32)
            if self.ids is not None:
                grown[: self.num_positions] = self.ids[: self.num_positions]
            self.ids = grown
        self.ids[chunk.start : end] = rows
        self.num_positions = end

    def array(self) -> np.ndarray | None:
        """The rows so far (a copy), or None when nothing came."""
        return None if self.ids is None else self.ids[: self.num_positions].copy()
