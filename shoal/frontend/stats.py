"""Per-iteration request statistics measured in the frontend: time to first token,
inter-token latencies and, for finished requests, end-to-end latency and its phases; for
finished prompts (a request's `n` completions together), their parameters `n` and
`max_tokens` and the longest completion."""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field

import msgspec

from shoal.protocol import EngineCoreOutput


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    queued_time: float  # arrival → first scheduled
    prefill_time: float  # first scheduled → first token
    decode_time: float  # first token → last token
    # Prompt tokens whose KV the engine computed (not found in the prefix cache).
    num_prefill_kv_computed_tokens: int = 0

    @property
    def inference_time(self) -> float:
        """First scheduled → last token: prefill and decode."""
        return self.prefill_time + self.decode_time


@dataclass
class FinishedPromptStats:
    """A prompt whose `n` completions have all finished."""

    n: int
    max_tokens: int  # the most tokens a completion could have (max_tokens, capped by the context)
    max_num_generation_tokens: int  # the longest completion's tokens


@dataclass
class IterationStats:
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    finished_prompts: list[FinishedPromptStats] = field(default_factory=list)


@dataclass
class _PromptState:
    n: int
    max_tokens: int
    num_unfinished: int
    max_num_generation_tokens: int = 0


@dataclass
class _RequestTimes:
    arrival_time: float
    num_prompt_tokens: int
    prompt: _PromptState | None = None
    first_token_time: float = 0.0
    last_token_time: float = 0.0
    num_generation_tokens: int = 0


class StatsTracker:
    """Follows each engine request (child request ids) from arrival to finish, and each prompt
    until its last completion has finished."""

    def __init__(self) -> None:
        self._requests: dict[str, _RequestTimes] = {}

    def add_request(
        self, request_id: str, arrival_time: float, num_prompt_tokens: int, prompt: _PromptState | None = None
    ) -> None:
        self._requests[request_id] = _RequestTimes(arrival_time, num_prompt_tokens, prompt)

    def add_prompt(self, child_ids: list[str], arrival_time: float, num_prompt_tokens: int, max_tokens: int) -> None:
        """A prompt and its `len(child_ids)` completions, each an engine request."""
        prompt = _PromptState(len(child_ids), max_tokens, len(child_ids))
        for child_id in child_ids:
            self.add_request(child_id, arrival_time, num_prompt_tokens, prompt)

    def remove(self, request_id: str) -> None:
        """An aborted request: neither it nor its prompt is reported."""
        times = self._requests.pop(request_id, None)
        if times is not None and times.prompt is not None:
            times.prompt.num_unfinished = -1  # never reaches 0

    def observe(
        self, outputs: list[EngineCoreOutput], now: float | None = None, stopped: Collection[str] = ()
    ) -> IterationStats:
        """One batch of outputs; `stopped`: the requests among them that a stop string ended in
        the frontend (the core, which aborts them, reports no finish for them)."""
        now = time.time() if now is None else now
        stats = IterationStats()
        for output in outputs:
            if output.request_id in stopped and output.finish_reason is None:
                output = msgspec.structs.replace(output, finish_reason="stop")
            times = self._requests.get(output.request_id)
            if times is None:
                continue
            num_new = len(output.new_token_ids)
            if num_new:
                if times.num_generation_tokens == 0:
                    stats.time_to_first_tokens.append(now - times.arrival_time)
                    stats.num_prompt_tokens += times.num_prompt_tokens
                    times.first_token_time = now
                else:
                    stats.inter_token_latencies.append((now - times.last_token_time) / num_new)
                times.last_token_time = now
                times.num_generation_tokens += num_new
                stats.num_generation_tokens += num_new
            if output.finish_reason is not None:
                stats.finished_requests.append(self._finished(output, times, now))
                del self._requests[output.request_id]
                self._finish_prompt(times, stats)
        return stats

    @staticmethod
    def _finish_prompt(times: _RequestTimes, stats: IterationStats) -> None:
        prompt = times.prompt
        if prompt is None or prompt.num_unfinished <= 0:
            return
        prompt.max_num_generation_tokens = max(prompt.max_num_generation_tokens, times.num_generation_tokens)
        prompt.num_unfinished -= 1
        if prompt.num_unfinished == 0:
            stats.finished_prompts.append(
                FinishedPromptStats(prompt.n, prompt.max_tokens, prompt.max_num_generation_tokens)
            )

    @staticmethod
    def _finished(output: EngineCoreOutput, times: _RequestTimes, now: float) -> FinishedRequestStats:
        scheduled = output.first_scheduled_time or times.arrival_time
        first_token = times.first_token_time or now
        return FinishedRequestStats(
            finish_reason=output.finish_reason or "abort",
            e2e_latency=now - times.arrival_time,
            num_prompt_tokens=times.num_prompt_tokens,
            num_generation_tokens=times.num_generation_tokens,
            queued_time=max(0.0, scheduled - times.arrival_time),
            prefill_time=max(0.0, first_token - scheduled),
            decode_time=max(0.0, times.last_token_time - first_token) if times.last_token_time else 0.0,
            num_prefill_kv_computed_tokens=max(0, times.num_prompt_tokens - output.num_cached_tokens),
        )
