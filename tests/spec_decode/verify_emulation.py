"""A verification "graph" for CPU tests: capture is a no-op and replay runs the model eagerly on
the padded step buffers, under the step's padded metadata (with the padded batch's real host
arrays, which the CPU attention reads): the rows a captured graph would compute."""

from __future__ import annotations

from typing import Any

import torch

from shoal.forward_context import AttentionMetadata, set_forward_context
from shoal.workers.model_runner import ModelRunner
from shoal.workers.verify_graphs import VerifyGraphRunner, verification_capture_sizes


class EagerVerifyRunner(VerifyGraphRunner):
    num_replays = 0
    # Of every replayed request, how many of its rows were real tokens (0: a padding request).
    real_rows: set[int] = set()

    def capture(self, pool: Any = None) -> None:
        return

    def replay(self, size: int, metadata: AttentionMetadata | None = None) -> torch.Tensor:
        assert metadata is not None and metadata.num_reqs == size
        assert metadata.num_tokens == size * self.query_len and metadata.max_query_len == self.query_len
        self.num_replays += 1
        written = (metadata.slot_mapping.view(size, self.query_len) >= 0).sum(dim=1)
        self.real_rows = self.real_rows | set(written.tolist())
        with set_forward_context(metadata):
            return self._forward(size)


def emulate_verify_graphs(runner: ModelRunner) -> EagerVerifyRunner:
    """Give the runner emulated verification graphs at the sizes it would capture."""
    spec = runner.config.speculative_config
    assert spec is not None
    query_len = spec.num_speculative_tokens + 1
    sizes = verification_capture_sizes(
        runner.config.scheduler_config.max_num_seqs,
        spec.disable_by_batch_size,
        query_len,
        runner.buffers["input_ids"].shape[0],
    )
    graphs = EagerVerifyRunner(runner._model, runner.buffers, sizes, query_len, runner.model_config.max_model_len)
    runner.verify_graphs = graphs
    return graphs
