"""What the prefill/decode proxy knows of its engines: `DisaggregationOptions` (how many of each
role, their resources, the timeouts and retries) and `EnginePool` (the engines of one role, taken
in turn, one that failed passed over until it answers again)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from dataclasses import dataclass
from typing import Any

# How often a failed engine is asked whether it is back.
_PROBE_INTERVAL_S = 0.2


@dataclass(frozen=True)
class DisaggregationOptions:
    num_prefill: int = 1
    num_decode: int = 1
    # Each engine actor's share of Ray's resources (GPU: below 1 to share one GPU).
    num_gpus_per_engine: float = 0.0
    num_cpus_per_engine: float = 1.0
    # A decode engine waits at most this long for a transfer to arrive.
    transfer_timeout_s: float = 10.0
    # An engine that gives no output this long is taken for dead (the request is retried).
    stall_timeout_s: float = 30.0
    # Tries of a request (prefill, transfer, decode) before it fails with a 503.
    max_attempts: int = 3
    # Ray re-creates an engine actor whose process died at most this many times.
    max_restarts: int = 3

    @staticmethod
    def parse(text: str, **kwargs: Any) -> DisaggregationOptions:
        """`prefill=N,decode=M` (the `--disaggregate` flag)."""
        counts: dict[str, int] = {}
        for part in text.split(","):
            role, _, number = part.partition("=")
            if role.strip() not in ("prefill", "decode") or not number.strip().isdigit():
                raise ValueError(f"--disaggregate takes prefill=N,decode=M, got {text!r}")
            counts[role.strip()] = int(number)
        if counts.get("prefill", 0) < 1 or counts.get("decode", 0) < 1:
            raise ValueError(f"--disaggregate needs at least one prefill and one decode engine, got {text!r}")
        return DisaggregationOptions(num_prefill=counts["prefill"], num_decode=counts["decode"], **kwargs)


class EnginePool:
    """The engines of one role, taken in turn; one that just failed is passed over until it
    answers again (`wait_for_one`)."""

    def __init__(self, role: str, actors: list[Any]) -> None:
        self.role = role
        self.actors = actors
        self.suspects: set[int] = set()  # indices of actors that failed a request
        self._turn = itertools.count()

    def next(self) -> Any:
        for _ in range(len(self.actors)):
            index = next(self._turn) % len(self.actors)
            if index not in self.suspects:
                return self.actors[index]
        return self.actors[next(self._turn) % len(self.actors)]

    def suspect(self, actor: Any) -> None:
        self.suspects.add(self.actors.index(actor))

    async def wait_for_one(self, timeout_s: float) -> bool:
        """Until an engine answers (a restarted one is back), at most `timeout_s`; the suspects
        that answer are cleared."""
        import ray

        deadline = time.monotonic() + timeout_s
        while True:
            for index in sorted(self.suspects):
                with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
                    await asyncio.wait_for(await_ref(self.actors[index].ready.remote()), 1.0)
                    self.suspects.discard(index)
            if len(self.suspects) < len(self.actors) or time.monotonic() >= deadline:
                return len(self.suspects) < len(self.actors)
            await asyncio.sleep(_PROBE_INTERVAL_S)


async def await_ref(ref: Any) -> Any:
    """A Ray object ref as a coroutine (for `asyncio.wait_for` and `gather`)."""
    return await ref
