"""`ScheduledStep`: one step as the scheduler builds it, kept until its output comes back."""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.engine_core.request import Request
from shoal.step import CachedRequestData, NewRequestData


@dataclass
class ScheduledStep:
    """One step as the scheduler builds it, kept until its output is applied."""

    budget: int  # tokens the step may still take
    weight_version: str  # the weights the step runs with
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # in batch order
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    # The requests it was built for: an output must reach the request it was computed for,
    # not a new one that reuses an aborted request's id.
    requests: dict[str, Request] = field(default_factory=dict)
    # Its prefill chunks: request id -> (first position, how many prompt tokens).
    prompt_chunks: dict[str, tuple[int, int]] = field(default_factory=dict)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)  # the drafts it verifies
