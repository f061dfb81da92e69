"""`InputBatch.update`: the worker's persistent batch after a random run of the scheduler's
diffs equals what a request-by-request replay of the same diffs says it should hold."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from shoal.sampling_params import SamplingParams
from shoal.step import CachedRequestData, NewRequestData, SchedulerOutput
from shoal.workers.input_batch import InputBatch

MAX_REQS, MAX_LEN, MAX_BLOCKS = 8, 64, 16


class Expected:
    """One request as the diffs describe it."""

    def __init__(self, new: NewRequestData) -> None:
        self.tokens = new.prompt_token_ids + new.output_token_ids
        self.outputs = list(new.output_token_ids)
        self.blocks = list(new.block_ids)
        self.num_computed_tokens = new.num_computed_tokens


def random_step(rng: random.Random, expected: dict[str, Expected], next_id: list[int]) -> SchedulerOutput:
    """Finish some requests, extend the rest by 0-3 tokens and 0-2 blocks, add new ones."""
    finished = [r for r in expected if rng.random() < 0.2]
    for req_id in finished:
        del expected[req_id]
    cached = []
    for req_id, request in expected.items():
        if rng.random() < 0.2:
            continue  # not scheduled this step
        num_new = min(rng.randint(0, 3), MAX_LEN - len(request.tokens))
        new_tokens = [rng.randrange(1000) for _ in range(num_new)]
        new_blocks = [rng.randrange(1000) for _ in range(min(rng.randint(0, 2), MAX_BLOCKS - len(request.blocks)))]
        request.tokens += new_tokens
        request.outputs += new_tokens
        request.blocks += new_blocks
        request.num_computed_tokens = len(request.tokens) - rng.randint(0, 1)
        cached.append(CachedRequestData(req_id, new_tokens, new_blocks, request.num_computed_tokens))
    new_reqs = []
    while len(expected) < MAX_REQS and rng.random() < 0.6:
        req_id = f"r{next_id[0]}"
        next_id[0] += 1
        prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 20))]
        params = SamplingParams(repetition_penalty=1.1) if rng.random() < 0.5 else SamplingParams()
        new = NewRequestData(req_id, prompt, [], params, [rng.randrange(1000) for _ in range(2)], 0)
        expected[req_id] = Expected(new)
        new_reqs.append(new)
    scheduled = [c.req_id for c in cached] + [n.req_id for n in new_reqs]
    return SchedulerOutput(new_reqs, cached, {r: 1 for r in scheduled}, len(scheduled), finished)


@pytest.mark.parametrize("seed", range(5))
def test_update_matches_a_request_by_request_replay(seed: int) -> None:
    rng = random.Random(seed)
    batch = InputBatch(MAX_REQS, MAX_LEN, MAX_BLOCKS, torch.device("cpu"))
    expected: dict[str, Expected] = {}
    next_id = [0]
    for _ in range(60):
        step = random_step(rng, expected, next_id)
        slots = batch.update(step)
        assert slots.tolist() == [batch.requests[r].slot for r in step.num_scheduled_tokens]
        assert set(batch.requests) == set(expected)
        assert len({state.slot for state in batch.requests.values()}) == len(expected)
        for req_id, request in expected.items():
            state = batch.requests[req_id]
            n, b = len(request.tokens), len(request.blocks)
            assert batch.num_tokens[state.slot] == n and batch.token_ids[state.slot, :n].tolist() == request.tokens
            assert batch.num_blocks[state.slot] == b and batch.block_table[state.slot, :b].tolist() == request.blocks
            assert batch.num_computed_tokens[state.slot] == request.num_computed_tokens
            if state.reads_output_tokens:  # penalties: the sampler reads the outputs
                assert state.output_token_ids == request.outputs
    assert next_id[0] > 2 * MAX_REQS  # slots were freed and reused


def test_a_step_that_extends_nothing_changes_nothing() -> None:
    batch = InputBatch(MAX_REQS, MAX_LEN, MAX_BLOCKS, torch.device("cpu"))
    new = NewRequestData("a", [1, 2, 3], [], SamplingParams(), [7], 2)
    batch.update(SchedulerOutput([new], [], {"a": 1}, 1))
    before = batch.token_ids.copy(), batch.block_table.copy(), batch.num_tokens.copy()
    slots = batch.update(SchedulerOutput([], [CachedRequestData("a", [], [], 3)], {"a": 1}, 1))
    assert slots.tolist() == [batch.requests["a"].slot]
    for array, copy in zip((batch.token_ids, batch.block_table, batch.num_tokens), before, strict=True):
        assert np.array_equal(array, copy)
    assert batch.num_computed_tokens[slots[0]] == 3
