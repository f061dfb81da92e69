"""The attention metadata the model runner builds once per step (the model itself runs in
tests/models and tests/test_correctness.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal.config import EngineArgs
from shoal.kernels import fresh_prefill_attention
from shoal.kernels.fresh_prefill_attention import PromptGroup
from shoal.workers.model_runner import ModelRunner


@pytest.fixture(scope="module")
def runner(tiny_checkpoints: dict) -> ModelRunner:
    config = EngineArgs(str(tiny_checkpoints["llama"]), device="cpu").create_engine_config()
    return ModelRunner(config, torch.device("cpu"))


def _metadata(runner: ModelRunner, query_lens: list[int], seq_lens: list[int]):
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)
    block_tables = np.zeros((len(query_lens), runner.max_blocks_per_req), dtype=np.int32)
    slot_mapping = np.zeros(int(query_start_loc[-1]), dtype=np.int64)
    seq_lens_array = np.array(seq_lens, dtype=np.int64)
    views = runner.buffers.load(**runner._attention_arrays(query_start_loc, seq_lens_array, block_tables, slot_mapping))
    return runner._attention_metadata(query_start_loc, seq_lens_array, views)


def test_prefill_steps_carry_the_fresh_prefill_plan(runner: ModelRunner, monkeypatch) -> None:
    monkeypatch.setattr(fresh_prefill_attention, "BY_SDPA", True)
    md = _metadata(runner, [16, 16, 1, 4], [16, 16, 40, 20])
    plan = md.fresh_prefill_plan
    assert plan is not None
    assert plan.groups == (PromptGroup(0, 2, 16),)
    assert (plan.num_decodes, plan.num_prefix_chunks) == (1, 1)


def test_decode_steps_build_no_plan(runner: ModelRunner) -> None:
    md = _metadata(runner, [1, 1, 1], [5, 9, 2])
    assert md.is_decode_only and md.fresh_prefill_plan is None


def test_prefill_steps_build_no_plan_with_fresh_prompts_left_to_the_paged_kernel(
    runner: ModelRunner, monkeypatch
) -> None:
    monkeypatch.setattr(fresh_prefill_attention, "BY_SDPA", False)
    assert _metadata(runner, [16, 16, 1, 4], [16, 16, 40, 20]).fresh_prefill_plan is None


def test_decode_order_takes_the_longest_context_first(runner: ModelRunner) -> None:
    """Every step carries its requests longest context first (ties in batch order): the order
    the decode kernel starts its programs in."""
    md = _metadata(runner, [1, 1, 1, 1, 4], [5, 900, 9, 900, 40])
    assert md.decode_order is not None
    assert md.decode_order.tolist() == [1, 3, 4, 2, 0]
