"""What `LLM.generate` returns (and `AsyncLLM.generate` yields): vLLM's output classes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

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
    # With `return_routed_experts` on a mixture-of-experts model: the experts each position
    # (prompt, then output tokens but the last) was routed to, int32 [num_positions,
    # num_hidden_layers, top_k], -1 in layers without routed experts; `shoal.rl.routing_masks`
    # turns them into a trainer's masks.
    routed_experts: np.ndarray | None = None

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
