"""What `LLM.generate` returns (and `AsyncLLM.generate` yields): vLLM's output classes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

# Per position: token id → its logprob (the sampled or actual token first, then the top-N).
PositionLogprobs = dict[int, "Logprob"]


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


class WeightVersionSpan(NamedTuple):
    """Tokens `start` to `end` (exclusive) of a completion's `token_ids` were sampled with the
    weights of version `version` (see `LLM.pause_generation` and docs/rl.md)."""

    version: str
    start: int
    end: int


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # Which weight version sampled which of `token_ids`: spans covering them in order (one span
    # unless the weights changed while the request ran).
    weight_versions: tuple[WeightVersionSpan, ...] = ()

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # Position 0 has no logprob (nothing predicts the first token).
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
