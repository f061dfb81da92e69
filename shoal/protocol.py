"""Every message that crosses the frontend ↔ engine-core boundary, as msgspec structs.

The frontend sends `EngineCoreRequest` (already tokenized and validated) and aborts; the core
answers with `EngineCoreOutputs`: per request the new token ids, logprobs and finish reason,
and per step the scheduler's statistics.
"""

from __future__ import annotations

import msgspec

from shoal.engine_core.batch import LogprobsLists
from shoal.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    # The most tokens this request may generate (already capped by max_model_len).
    max_tokens: int


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_used_blocks: int = 0
    prefix_cache_queries: int = 0  # cumulative, in tokens
    prefix_cache_hits: int = 0  # cumulative, in tokens
    num_preemptions: int = 0  # cumulative
    num_prompt_tokens: int = 0  # computed this step
    num_generation_tokens: int = 0  # sampled this step


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
