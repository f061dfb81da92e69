"""`Request`: one sequence's state inside the engine core, from arrival to finish."""

from __future__ import annotations

import enum
import sys
import time
from typing import TYPE_CHECKING

from shoal.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shoal.step import LogprobsLists
    from shoal.structured_output.manager import StructuredRequest


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_GRAMMAR = enum.auto()  # kept by the structured-output manager until it compiles
    WAITING_FOR_KV = enum.auto()  # parked, its blocks allocated, until its KV is loaded (remote_kv.py)
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this point is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """A prompt and its generated tokens, and how far the KV cache has computed them.

    `num_computed_tokens` counts tokens whose KV is in the cache (or scheduled to be written
    this step); `num_tokens - num_computed_tokens` tokens are still to be computed.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        max_tokens: int,
        arrival_time: float | None = None,
        lora_name: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.max_tokens = max_tokens
        # Async scheduling may run the request ahead of its known tokens (see
        # Scheduler._may_run_ahead) only from this many output tokens on: never when penalties
        # count its tokens, and not before min_tokens, by whose count the sampler masks EOS.
        self.runs_ahead_from = sys.maxsize if sampling_params.uses_penalties else sampling_params.min_tokens
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        # len(all_token_ids) and the outputs among them, kept by append_output_token_id (the only
        # writer): the scheduler reads them several times per request and step, where a property
        # call is measurable.
        self.num_tokens = self.num_prompt_tokens
        self.num_output_tokens = 0
        self.num_computed_tokens = 0
        # Tokens being sampled by steps still in flight (async scheduling runs a request one
        # step ahead of its known tokens; the workers feed those tokens in on the device).
        self.num_output_placeholders = 0
        # Steps still executing that include this request (kept by the scheduler).
        self.num_steps_in_flight = 0
        # Prompt tokens found in the prefix cache when first scheduled (-1: not yet scheduled).
        self.num_cached_tokens = -1
        self.first_scheduled_time: float | None = None
        # Hashes of the request's full blocks, extended as tokens arrive (see KVCacheManager).
        self.block_hashes: list[bytes] = []
        self.stop_reason: int | str | None = None
        # Output tokens the workers have not been told about yet (sent with the next step).
        self.num_output_tokens_sent = 0
        # Prompt positions whose logprobs the frontend has (a recompute must not send them again).
        self.num_prompt_logprobs_sent = 0
        self.num_preemptions = 0
        # Its grammar and matcher, for a request with structured output (see StructuredOutputManager).
        self.structured_output: StructuredRequest | None = None
        # Seams for what comes next, carried but not used yet: the LoRA adapter it runs with
        # (None: the base model), and draft tokens proposed for its next step (speculative
        # decoding; they would travel in `SchedulerOutput.scheduled_spec_decode_tokens`).
        self.lora_name = lora_name
        self.spec_token_ids: list[int] = []

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def append_output_token_id(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.num_tokens += 1
        self.num_output_tokens += 1

    def take_unsent_output_token_ids(self) -> list[int]:
        """Output tokens sampled since the workers last heard of this request."""
        unsent = self.all_token_ids[self.num_prompt_tokens + self.num_output_tokens_sent :]
        self.num_output_tokens_sent = self.num_output_tokens
        return unsent

    def take_unsent_prompt_logprobs(self, rows: LogprobsLists, start: int) -> LogprobsLists | None:
        """The rows of prompt positions the frontend has not had yet. Row i is prompt position
        `start + i`; after a preemption the prompt is computed again from position 0, and its
        rows come again."""
        num_sent, num_rows = self.num_prompt_logprobs_sent, len(rows.ranks)
        self.num_prompt_logprobs_sent = max(num_sent, start + num_rows)
        if start + num_rows <= num_sent:
            return None
        return rows.slice(num_sent - start, num_rows) if start < num_sent else rows

    def check_stop(self, max_model_len: int) -> bool:
        """Finish the request if its last token ends it; True when it did."""
        params = self.sampling_params
        last = self.all_token_ids[-1]
        num_output_tokens = self.num_output_tokens
        if num_output_tokens >= params.min_tokens:
            if last == self.eos_token_id and not params.ignore_eos:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False
