"""The LM head runs at a row count from a fixed set (the decode graphs' batch sizes), padded and
sliced back, so that no step meets a GEMM shape for the first time (ModelRunner._logits)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from shoal import LLM
from shoal.workers.cuda_graphs import capture_sizes, round_up_to_size


@pytest.fixture(scope="module")
def runner(tiny_checkpoints: dict[str, Path]):
    with LLM(str(tiny_checkpoints["llama"]), multiprocess=False, max_num_seqs=64) as llm:
        yield llm.engine_core.core.executor.worker.runner


def test_row_counts_round_up_to_the_graph_sizes() -> None:
    sizes = capture_sizes(64)
    assert [round_up_to_size(sizes, n) for n in (1, 3, 5, 8, 9, 63, 64)] == [1, 4, 8, 8, 16, 64, 64]
    assert round_up_to_size(sizes, 65) is None


@pytest.mark.parametrize(
    "num_tokens, num_hidden_rows, rows, gathers",
    [
        (5, 5, [0, 1, 2, 3, 4], True),  # an eager decode of 5: every row samples, the LM head runs 8
        (5, 8, [0, 1, 2, 3, 4], False),  # a decode of 5 replayed at graph size 8: the padded rows as they are
        (4, 4, [0, 1, 2, 3], False),  # a decode of a graph size
        (20, 20, [3, 11, 19], True),  # a prefill step: the last token of each finished prompt
    ],
)
def test_logits_are_those_of_the_sampling_rows(
    runner, monkeypatch, num_tokens: int, num_hidden_rows: int, rows: list[int], gathers: bool
) -> None:
    hidden = torch.randn(num_hidden_rows, runner.model_config.hf_config.hidden_size)
    expected = runner._model.compute_logits(hidden[rows])
    seen = []
    original = runner._model.compute_logits
    monkeypatch.setattr(runner._model, "compute_logits", lambda h: seen.append(h.shape[0]) or original(h))
    to_device = runner._to_device
    indices = []
    monkeypatch.setattr(runner, "_to_device", lambda a: indices.append(a.tolist()) or to_device(a))
    logits = runner._logits(hidden, np.array(rows), num_tokens)
    padded = round_up_to_size(runner.logits_row_counts, len(rows))
    assert seen == [padded]
    assert indices == ([rows + [0] * (padded - len(rows))] if gathers else [])
    torch.testing.assert_close(logits, expected)


def test_start_up_meets_every_row_count(runner, monkeypatch) -> None:
    """What warm_up_logits runs on a GPU (the CPU has no first-use cost to hide)."""
    seen = []
    original = runner._model.compute_logits
    monkeypatch.setattr(runner._model, "compute_logits", lambda h: seen.append(h.shape[0]) or original(h))
    runner.warm_up_logits()
    assert seen == []  # on the CPU: nothing
    runner._run_lm_head_at_every_row_count()
    assert seen == capture_sizes(64)
