"""The server's overload limits: how many requests may wait, how long one may take, how long a
stream may stall, and whether a request's sequences can fit in the KV cache at all.

A request holds `n` sequences per prompt from its admission until its response ends. The
scheduler runs at most `max_num_seqs` of them at once; every sequence beyond that waits, so the
server admits at most `max_num_seqs + max_num_waiting_requests` sequences and answers the rest
with a 429 and `Retry-After` (OpenAI's answer to a rate limit), before anything reaches the
engine. The default queue is sized from the KV cache: as many sequences as it holds at a
quarter of `max_model_len` each (a queue that the running batch can absorb in about one
turn), and never fewer than `max_num_seqs`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypeVar

from shoal.entrypoints.openai.errors import bad_request, request_timed_out, too_many_waiting

logger = logging.getLogger(__name__)

T = TypeVar("T")
# What a 429 tells the client to wait before retrying: about one decode turn of the batch.
RETRY_AFTER_S = 1.0


@dataclass(frozen=True)
class ServingLimits:
    """The `shoal serve` flags behind the limits (None: the default, or no limit)."""

    max_num_waiting_requests: int | None = None  # None: sized from the KV cache
    request_timeout_s: float | None = None  # None: no timeout
    stream_stall_timeout_s: float | None = 60.0  # None: a stream may stall forever


def default_max_num_waiting(num_kv_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int) -> int:
    """As many sequences as the KV cache holds at a quarter of max_model_len each, at least
    max_num_seqs."""
    quarter_len = max(1, max_model_len // 4)
    return max(max_num_seqs, num_kv_blocks * block_size // quarter_len)


class Admission:
    """Counts the sequences (and requests) the server holds; `admit` refuses past the limit
    with a 429."""

    def __init__(self, max_num_running: int, max_num_waiting: int) -> None:
        self.max_num_running = max_num_running
        self.max_num_waiting = max_num_waiting
        self.num_seqs = 0
        # Admitted requests whose responses have not ended (`GET /load`).
        self.num_requests = 0

    @property
    def num_waiting(self) -> int:
        return max(0, self.num_seqs - self.max_num_running)

    def admit(self, num_seqs: int) -> Ticket:
        if self.num_seqs + num_seqs > self.max_num_running + self.max_num_waiting:
            raise too_many_waiting(self.max_num_waiting, RETRY_AFTER_S)
        self.num_seqs += num_seqs
        self.num_requests += 1
        return Ticket(self, num_seqs)


class Ticket:
    """An admitted request's hold on the server; `release` (idempotent) gives it back."""

    def __init__(self, admission: Admission, num_seqs: int) -> None:
        self._admission = admission
        self._num_seqs = num_seqs
        self._held = True

    def release(self) -> None:
        if self._held:
            self._admission.num_seqs -= self._num_seqs
            self._admission.num_requests -= 1
            self._held = False


class KVCacheFit:
    """A 400 for a request whose sequences, each at its full length, need more KV blocks than
    the cache has: it could never run all at once, only through endless preemption."""

    def __init__(self, num_kv_blocks: int | None, block_size: int) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size

    def check(self, num_prompt_tokens: int, num_seqs: int, max_tokens: int | None) -> None:
        if self.num_kv_blocks is None or max_tokens is None or num_seqs == 1:
            return  # one sequence always fits: the engine checked max_model_len against the cache
        num_blocks = num_seqs * math.ceil((num_prompt_tokens + max_tokens) / self.block_size)
        if num_blocks > self.num_kv_blocks:
            raise bad_request(
                f"This request's {num_seqs} sequences of up to {num_prompt_tokens + max_tokens} tokens need "
                f"{num_blocks} KV-cache blocks, but the cache has {self.num_kv_blocks}. "
                "Please reduce n or max_tokens.",
                "n",
            )


async def with_deadline(stream: AsyncIterator[T], deadline: float | None, timeout_s: float) -> AsyncIterator[T]:
    """The stream's items until the event loop's clock reaches `deadline`; then the stream is
    closed (the engine aborts its requests and frees their blocks) and a 503 raised."""
    try:
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    item = await anext(stream)
            except StopAsyncIteration:
                return
            except TimeoutError:
                logger.info("A request ran past the request timeout of %g s; it was aborted", timeout_s)
                raise request_timed_out(timeout_s, RETRY_AFTER_S) from None
            yield item
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(RuntimeError):  # already closed by the cancellation
                await aclose()
