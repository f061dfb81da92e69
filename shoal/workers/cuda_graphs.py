"""`CudaGraphRunner`: decode steps replayed from CUDA graphs.

A decode step launches a few hundred small kernels; on a GPU their launch cost, not the work,
would bound small batches. So the model forward of a pure-decode batch is captured once per
padded batch size (1, 2, 4, 8, then steps of 8 up to 256 and of 16 up to 512 or `max_num_seqs`)
and replayed: one launch. Larger decode batches run eagerly: their GEMMs take tens of
microseconds each, so launches no longer bound them, and capture stays short.
Graphs read their inputs from the fixed `StepBuffers`; a batch of n requests runs the graph of
the smallest captured size >= n, its extra rows padded so that they write nowhere (slot -1) and
attend to one cached token. The runner appends those rows (`padding_rows`) to the step's host
arrays, so they reach the device in the step's own copies rather than as a handful of fill
kernels per replay. Prefill and mixed batches run eagerly; speculative decoding's verification
steps have graphs of their own (verify_graphs.py).
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from shoal.forward_context import AttentionMetadata, set_forward_context
from shoal.workers.step_buffers import StepBuffers

logger = logging.getLogger(__name__)


MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    largest = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4) if s <= largest]
    sizes += list(range(8, min(largest, 256) + 1, 8))
    sizes += list(range(272, largest + 1, 16))
    if sizes[-1] != largest:
        sizes.append(largest)
    return sizes


def round_up_to_size(sizes: list[int], n: int) -> int | None:
    """The smallest of the (sorted) `sizes` that is at least n; None past the largest."""
    index = bisect.bisect_left(sizes, n)
    return sizes[index] if index < len(sizes) else None


def padding_rows(num_reqs: int, size: int, num_block_columns: int) -> dict[str, np.ndarray]:
    """Rows num_reqs..size of a decode padded to a graph's `size`, by step buffer: token 0 at
    position 0, written nowhere (slot -1), attending to one token of block 0 (finite values; the
    rows are discarded), one query token each (so `query_start_loc` continues past the batch's
    end, entries num_reqs+1..size), their programs after the batch's own (`decode_order`)."""
    num_rows = size - num_reqs
    return {
        "input_ids": np.zeros(num_rows, dtype=np.int64),
        "positions": np.zeros(num_rows, dtype=np.int64),
        "slot_mapping": np.full(num_rows, -1, dtype=np.int64),
        "seq_lens": np.ones(num_rows, dtype=np.int32),
        "block_tables": np.zeros((num_rows, num_block_columns), dtype=np.int32),
        "decode_order": np.arange(num_reqs, size, dtype=np.int32),
        "query_start_loc": np.arange(num_reqs + 1, size + 1, dtype=np.int32),
    }


class CudaGraphRunner:
    # What the graphs run, for the logs.
    kind = "decode"

    def __init__(
        self,
        model: torch.nn.Module,
        buffers: StepBuffers,
        max_num_seqs: int,
        max_seq_len: int,
    ) -> None:
        self.model = model
        self.buffers = buffers
        self.sizes = capture_sizes(max_num_seqs)
        # Kernels size their grids from max_seq_len when captured; the longest context keeps
        # every later replay inside the grid.
        self.max_seq_len = max_seq_len
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool: Any = None  # the graphs' memory pool (torch.cuda.graph_pool_handle)

    def padded_size(self, num_reqs: int) -> int | None:
        """The captured batch size a decode of `num_reqs` requests runs at, if any."""
        return round_up_to_size(self.sizes, num_reqs)

    @torch.inference_mode()
    def capture(self, pool: Any = None) -> None:
        """Capture a graph per size, in `pool` if given (another runner's: graphs replayed one
        at a time may share their memory)."""
        start = time.perf_counter()
        pool = self.pool = pool or torch.cuda.graph_pool_handle()
        # Largest first: smaller graphs then fit in the memory the largest one reserved.
        sizes = sorted(self.sizes, reverse=True)
        for size in tqdm(sizes, desc=f"Capturing {self.kind} CUDA graphs", dynamic_ncols=True):
            self._load_padding_only(size)
            metadata = self.metadata(size)
            with set_forward_context(metadata):
                self._forward(size)  # warm up: autotuning and lazy initialization run outside capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info(
            "Captured %d %s CUDA graphs (batch sizes 1..%d) in %.1f s",
            len(self.graphs),
            self.kind,
            self.sizes[-1],
            time.perf_counter() - start,
        )

    def replay(self, size: int, metadata: AttentionMetadata | None = None) -> torch.Tensor:
        """Run the decode already loaded into the buffers, padded to `size` rows (`padding_rows`);
        returns the hidden states of all `size` rows: the requests' first, then the padding's.
        `metadata`: the step's own (a graph reads the views it was captured with; a runner that
        replays eagerly, as CPU tests do, runs under it)."""
        self.graphs[size].replay()
        return self.outputs[size]

    def metadata(self, size: int) -> AttentionMetadata:
        """The attention metadata a captured graph of `size` decodes sees: views of the buffers."""
        b = self.buffers
        return AttentionMetadata(
            num_reqs=size,
            num_tokens=size,
            max_query_len=1,
            max_seq_len=self.max_seq_len,
            query_start_loc=b["query_start_loc"][: size + 1],
            seq_lens=b["seq_lens"][:size],
            block_tables=b["block_tables"][:size],
            slot_mapping=b["slot_mapping"][:size],
            query_start_loc_cpu=torch.arange(size + 1, dtype=torch.int32),
            seq_lens_cpu=torch.ones(size, dtype=torch.int32),
            is_decode_only=True,
            decode_order=b["decode_order"][:size],
        )

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.buffers["input_ids"][:size], self.buffers["positions"][:size])

    def _load_padding_only(self, size: int) -> None:
        """A batch of `size` padding rows, to capture the graph on."""
        arrays = padding_rows(0, size, num_block_columns=1)
        arrays["query_start_loc"] = np.arange(size + 1, dtype=np.int32)
        self.buffers.load(**arrays)
