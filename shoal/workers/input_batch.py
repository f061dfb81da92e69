"""`InputBatch`: the worker's persistent copy of every running request, updated by the
scheduler's diffs, from which each step's flat model inputs are gathered with numpy.

Each request owns a slot (a row of the token and block-table arrays) from the step it is first
scheduled until it finishes or is preempted.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from shoal.sampling_params import SamplingParams
from shoal.step import CachedRequestData, NewRequestData, SchedulerOutput


@dataclass
class RequestState:
    req_id: str
    slot: int
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_id: int | None
    generator: torch.Generator | None
    # Kept up to date only where the sampler reads them (`reads_output_tokens`).
    output_token_ids: list[int] = field(default_factory=list)
    # The prompt, kept for penalties (repetition penalty covers prompt and output).
    prompt_token_ids: list[int] = field(default_factory=list)
    # What the sampler asks of the parameters every step, worked out once.
    greedy: bool = field(init=False)
    temperature: float = field(init=False)  # 1.0 where greedy
    reads_output_tokens: bool = field(init=False)  # penalties count them, min_tokens their number
    # Temperature (or greedy) alone: no top-k/p, min-p, penalties, min_tokens, logit_bias,
    # allowed_token_ids, logprobs or seed (a grammar's bitmask is applied to any row, plain or not).
    plain: bool = field(init=False)

    def __post_init__(self) -> None:
        params = self.sampling_params
        self.greedy = params.greedy
        self.temperature = 1.0 if self.greedy else params.temperature
        self.reads_output_tokens = params.uses_penalties or params.min_tokens > 0
        self.plain = (
            not self.reads_output_tokens
            and params.top_k == 0
            and params.top_p == 1.0
            and params.min_p == 0.0
            and params.logprobs is None
            and params.logit_bias is None
            and params.allowed_token_ids is None
            and self.generator is None
        )


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, device: torch.device):
        self.max_num_reqs = max_num_reqs
        self.device = device
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        # Speculative decoding: draft tokens written past `num_tokens` for this step (not known).
        self.num_draft_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # Per slot, the sampling facts a plain batch's metadata is gathered from (RequestState).
        self.plain = np.zeros(max_num_reqs, dtype=bool)
        self.temperature = np.ones(max_num_reqs, dtype=np.float32)
        self.greedy = np.zeros(max_num_reqs, dtype=bool)
        self.requests: dict[str, RequestState] = {}
        # The requests that asked for prompt logprobs (few or none: the runner skips the rest).
        self.wants_prompt_logprobs: set[str] = set()
        # How many of them keep their output tokens for the sampler (none: no list to extend).
        self.num_reading_output_tokens = 0
        self._free_slots = list(range(max_num_reqs - 1, -1, -1))

    def update(self, scheduler_output: SchedulerOutput) -> np.ndarray:
        """Apply one step's diffs: drop finished requests, add new ones, extend cached ones.
        Returns the scheduled requests' slots in batch order (cached requests, then new ones:
        the order of `scheduler_output.num_scheduled_tokens`)."""
        for req_id in scheduler_output.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self._forget(state)
        cached_slots = self._extend(scheduler_output.cached_reqs)
        new_slots = [self._add(new) for new in scheduler_output.new_reqs]
        return np.concatenate([cached_slots, np.array(new_slots, dtype=np.int64)])

    def _add(self, new: NewRequestData) -> int:
        if new.req_id in self.requests:  # rebuilt after a preemption the worker did not see
            self._forget(self.requests.pop(new.req_id))
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
        if params.prompt_logprobs is not None:
            self.wants_prompt_logprobs.add(new.req_id)
        self.num_reading_output_tokens += state.reads_output_tokens
        self.plain[slot], self.temperature[slot], self.greedy[slot] = state.plain, state.temperature, state.greedy
        tokens = new.prompt_token_ids + new.output_token_ids
        self.token_ids[slot, : len(tokens)] = tokens
        self.num_tokens[slot] = len(tokens)
        self.num_computed_tokens[slot] = new.num_computed_tokens
        self.block_table[slot, : len(new.block_ids)] = new.block_ids
        self.num_blocks[slot] = len(new.block_ids)
        return slot

    def _forget(self, state: RequestState) -> None:
        self._free_slots.append(state.slot)
        self.wants_prompt_logprobs.discard(state.req_id)
        self.num_reading_output_tokens -= state.reads_output_tokens

    def _extend(self, cached_reqs: list[CachedRequestData]) -> np.ndarray:
        """Apply the diffs of requests the worker holds: one pass over them in Python to
        gather the diffs, then a few array operations (a decode step extends every running
        request, where one numpy call per request would cost more than the step's arithmetic)."""
        requests = self.requests
        slots = np.fromiter((requests[c.req_id].slot for c in cached_reqs), dtype=np.int64, count=len(cached_reqs))
        new_token_ids = [cached.new_token_ids for cached in cached_reqs]
        _append_rows(self.token_ids, self.num_tokens, slots, new_token_ids)
        _append_rows(self.block_table, self.num_blocks, slots, [cached.new_block_ids for cached in cached_reqs])
        self.num_computed_tokens[slots] = [cached.num_computed_tokens for cached in cached_reqs]
        if self.num_reading_output_tokens:
            for cached in cached_reqs:
                state = requests[cached.req_id]
                if cached.new_token_ids and state.reads_output_tokens:
                    state.output_token_ids.extend(cached.new_token_ids)
        return slots


def _append_rows(table: np.ndarray, lengths: np.ndarray, slots: np.ndarray, rows: list[list[int]]) -> None:
    """Append `rows[i]` to row `slots[i]` of `table`, after its first `lengths[slots[i]]`
    entries, and count them in `lengths` (slots are distinct)."""
    counts = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))  # [num_rows]
    num_new = int(counts.sum())
    if num_new == 0:
        return
    # Entry j of the flattened rows goes to row slots[r] at column lengths[slots[r]] + k, where
    # r is its row and k its index within that row.
    first_entry = np.cumsum(counts) - counts  # [num_rows] index of each row's first entry
    columns = np.repeat(lengths[slots] - first_entry, counts) + np.arange(num_new)  # [num_new]
    table[np.repeat(slots, counts), columns] = list(itertools.chain.from_iterable(rows))
    lengths[slots] += counts
