"""`InputBatch`: the worker's persistent copy of every running request, updated by the
scheduler's diffs, from which each step's flat model inputs are gathered with numpy.

Each request owns a slot (a row of the token and block-table arrays) from the step it is first
scheduled until it finishes or is preempted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from shoal.engine_core.batch import CachedRequestData, NewRequestData, SchedulerOutput
from shoal.sampling_params import SamplingParams


@dataclass
class RequestState:
    req_id: str
    slot: int
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_id: int | None
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)
    # The prompt, kept for penalties (repetition penalty covers prompt and output).
    prompt_token_ids: list[int] = field(default_factory=list)


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, device: torch.device):
        self.max_num_reqs = max_num_reqs
        self.device = device
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.requests: dict[str, RequestState] = {}
        self._free_slots = list(range(max_num_reqs - 1, -1, -1))

    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Apply one step's diffs: drop finished requests, add new ones, extend cached ones."""
        for req_id in scheduler_output.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self._free_slots.append(state.slot)
        for new in scheduler_output.new_reqs:
            self._add(new)
        for cached in scheduler_output.cached_reqs:
            self._extend(cached)

    def _add(self, new: NewRequestData) -> None:
        if new.req_id in self.requests:  # rebuilt after a preemption the worker did not see
            self._free_slots.append(self.requests.pop(new.req_id).slot)
        slot = self._free_slots.pop()
        params = new.sampling_params
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        state = RequestState(
            req_id=new.req_id,
            slot=slot,
            num_prompt_tokens=len(new.prompt_token_ids),
            sampling_params=params,
            eos_token_id=new.eos_token_id,
            generator=generator,
            output_token_ids=list(new.output_token_ids),
            prompt_token_ids=list(new.prompt_token_ids),
        )
        self.requests[new.req_id] = state
        tokens = new.prompt_token_ids + new.output_token_ids
        self.token_ids[slot, : len(tokens)] = tokens
        self.num_tokens[slot] = len(tokens)
        self.num_computed_tokens[slot] = new.num_computed_tokens
        self.block_table[slot, : len(new.block_ids)] = new.block_ids
        self.num_blocks[slot] = len(new.block_ids)

    def _extend(self, cached: CachedRequestData) -> None:
        state = self.requests[cached.req_id]
        slot = state.slot
        if cached.new_token_ids:
            n = int(self.num_tokens[slot])
            self.token_ids[slot, n : n + len(cached.new_token_ids)] = cached.new_token_ids
            self.num_tokens[slot] = n + len(cached.new_token_ids)
            state.output_token_ids.extend(cached.new_token_ids)
        if cached.new_block_ids:
            b = int(self.num_blocks[slot])
            self.block_table[slot, b : b + len(cached.new_block_ids)] = cached.new_block_ids
            self.num_blocks[slot] = b + len(cached.new_block_ids)
        self.num_computed_tokens[slot] = cached.num_computed_tokens
