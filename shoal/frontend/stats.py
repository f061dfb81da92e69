"""Per-iteration request statistics measured in the frontend: time to first token,
inter-token latencies and, for finished requests, end-to-end latency and its phases."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

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


@dataclass
class IterationStats:
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


@dataclass
class _RequestTimes:
    arrival_time: float
    num_prompt_tokens: int
    first_token_time: float = 0.0
    last_token_time: float = 0.0
    num_generation_tokens: int = 0


class StatsTracker:
    """Follows each engine request (child request ids) from arrival to finish."""

    def __init__(self) -> None:
        self._requests: dict[str, _RequestTimes] = {}

    def add_request(self, request_id: str, arrival_time: float, num_prompt_tokens: int) -> None:
        self._requests[request_id] = _RequestTimes(arrival_time, num_prompt_tokens)

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def observe(self, outputs: list[EngineCoreOutput], now: float | None = None) -> IterationStats:
        now = time.time() if now is None else now
        stats = IterationStats()
        for output in outputs:
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
        return stats

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
        )
