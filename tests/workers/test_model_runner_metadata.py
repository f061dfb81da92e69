"""The attention metadata the model runner builds once per step (the model itself runs in
tests/models and tests/test_correctness.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal.config import EngineArgs
from shoal.kernels import fresh_prefill_attention
from shoal.kernels.fresh_prefill_attention import PromptGroup
from shoal.sampling_params import SamplingParams
from shoal.step import NewRequestData, SchedulerOutput
from shoal.workers import sampler as sampler_module
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


class GraphSizes:
    """Stands in for the CUDA graphs (GPU only): decodes of up to 4 requests replay at size 4."""

    def padded_size(self, num_reqs: int) -> int | None:
        return 4 if num_reqs <= 4 else None


def decode_step(runner: ModelRunner, contexts: list[int], step_id: int):
    """Requests with `contexts[i]` tokens in the cache each decoding their next token."""
    requests = [
        NewRequestData(f"r{step_id}-{i}", list(range(1, n + 2)), [], SamplingParams(), [i, 7], n)
        for i, n in enumerate(contexts)
    ]
    out = SchedulerOutput(requests, [], {r.req_id: 1 for r in requests}, len(requests), step_id=step_id)
    return out, runner.input_batch.update(out)


def test_a_decode_replayed_at_a_graph_size_loads_the_padding_rows(runner: ModelRunner, monkeypatch) -> None:
    """The padding rows go to the device with the step's inputs (`padding_rows`); the step's own
    inputs and metadata keep the batch's rows."""
    monkeypatch.setattr(runner, "cuda_graphs", GraphSizes())
    for tensor in runner.buffers.device_tensors.values():
        tensor.fill_(99)  # stale values from earlier steps
    out, slots = decode_step(runner, [5, 20, 9], step_id=1)
    inputs = runner._prepare_inputs(out, slots)
    md = inputs.attn_metadata
    assert (md.num_reqs, md.num_tokens, len(inputs.input_ids), len(md.seq_lens)) == (3, 3, 3, 3)
    assert md.seq_lens.tolist() == [6, 21, 10] and md.query_start_loc.tolist() == [0, 1, 2, 3]
    b = runner.buffers
    # Row 3 is padding: token 0 at position 0, no slot, one token of block 0, programs after the batch's.
    assert (b["input_ids"][3], b["positions"][3], b["slot_mapping"][3], b["seq_lens"][3]) == (0, 0, -1, 1)
    assert b["block_tables"][3, 0] == 0 and b["query_start_loc"][:5].tolist() == [0, 1, 2, 3, 4]
    assert b["decode_order"][:4].tolist() == [1, 2, 0, 3]


def test_eager_steps_load_no_padding(runner: ModelRunner, monkeypatch) -> None:
    monkeypatch.setattr(runner, "cuda_graphs", GraphSizes())
    out, slots = decode_step(runner, [3, 4, 5, 6, 7], step_id=2)  # 5 decodes: past the largest graph
    for tensor in runner.buffers.device_tensors.values():
        tensor.fill_(99)
    runner._prepare_inputs(out, slots)
    assert runner.buffers["seq_lens"][5] == 99 and runner.buffers["slot_mapping"][5] == 99


@pytest.mark.parametrize(
    "params, plain",
    [
        ([SamplingParams(temperature=0.6), SamplingParams(temperature=0.0), SamplingParams(temperature=1.3)], True),
        ([SamplingParams(temperature=0.6), SamplingParams(top_p=0.5), SamplingParams(temperature=0.0)], False),
    ],
)
def test_a_plain_batch_brings_its_sampling_metadata_with_its_inputs(
    runner: ModelRunner, params: list[SamplingParams], plain: bool
) -> None:
    """Temperatures and greedy flags of a plain batch are gathered from the input batch and
    loaded with the step's inputs; they equal what the general build makes from the states."""
    requests = [NewRequestData(f"s{plain}-{i}", [1, 2, 3], [], p, [i], 2) for i, p in enumerate(params)]
    out = SchedulerOutput(requests, [], {r.req_id: 1 for r in requests}, len(requests), step_id=9)
    inputs = runner._prepare_inputs(out, runner.input_batch.update(out))
    states = [runner.input_batch.requests[r] for r in inputs.sampling_req_ids]
    assert (inputs.sampling_metadata is not None) == plain
    built = sampler_module._general_sampling_metadata(states, 50, torch.device("cpu"))
    metadata = runner.sampling_metadata(inputs, states, 50)
    assert torch.equal(metadata.temperature, built.temperature) and torch.equal(metadata.greedy, built.greedy)
    assert (metadata.all_greedy, metadata.any_greedy, metadata.top_p is None) == (False, True, plain)


def test_profile_step_of_a_short_context_engine_fits_its_sequence_rows(tiny_checkpoints: dict) -> None:
    """The memory profile's dummy step splits max_num_batched_tokens into max_model_len-long
    sequences; with few sequences and a short context it keeps to max_num_seqs of them, as a
    real step must (before, 8,192 tokens of 256 made 32 sequences for 8 rows and start failed)."""
    config = EngineArgs(
        str(tiny_checkpoints["llama"]), device="cpu", max_num_seqs=8, max_model_len=256, max_num_batched_tokens=8192
    ).create_engine_config()
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    runner._dummy_step(config.scheduler_config.max_num_batched_tokens)
