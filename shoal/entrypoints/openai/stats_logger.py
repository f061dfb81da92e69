"""A line in the log every few seconds: throughput, queue lengths, KV-cache use, prefix hits.

    Avg prompt throughput: 512.0 tokens/s, Avg generation throughput: 96.3 tokens/s,
    Running: 4 reqs, Waiting: 0 reqs, KV cache usage: 3.1%, Prefix cache hit rate: 42.0%

and, when the engine speculates, the interval's draft acceptance rate (accepted / draft tokens)
and mean accepted length (tokens emitted per verification: 1 + accepted / verifications).

Token counts come from the engine's stats listener; queue lengths, KV-cache usage and the
prefix-cache counters from `AsyncLLM.get_stats()` at each tick (the same call refreshes the
Prometheus gauges). The hit rate covers the interval when it had lookups, else all time.
An idle engine is logged once, not every interval.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from shoal.errors import EngineDeadError

if TYPE_CHECKING:
    from shoal.entrypoints.openai.metrics import ServerMetrics
    from shoal.frontend.async_llm import AsyncLLM
    from shoal.frontend.stats import IterationStats
    from shoal.protocol import SchedulerStats

logger = logging.getLogger(__name__)

_GET_STATS_TIMEOUT_S = 5.0


class StatsLogger:
    def __init__(self, engine: AsyncLLM, interval_s: float, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.interval_s = interval_s
        self.metrics = metrics
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._last_time = time.monotonic()
        self._last_prefix_queries = 0
        self._last_prefix_hits = 0
        self._logged_idle = False
        self._last_spec: tuple[int, int, int] = (0, 0, 0)  # drafts, draft tokens, accepted

    def on_stats(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats) -> None:
        """The engine's stats listener: called once per batch of outputs."""
        self._num_prompt_tokens += iteration_stats.num_prompt_tokens
        self._num_generation_tokens += iteration_stats.num_generation_tokens

    async def run(self) -> None:
        """Log every `interval_s` until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.log_once()

    async def log_once(self) -> None:
        if self.engine.errored:
            return
        try:
            stats = await asyncio.wait_for(self.engine.get_stats(), _GET_STATS_TIMEOUT_S)
        except (EngineDeadError, TimeoutError):
            return
        if self.metrics is not None:
            self.metrics.set_engine_stats(stats)
        line = self.format_line(stats, time.monotonic())
        if line is not None:
            logger.info(line)

    def format_line(self, stats: dict[str, Any], now: float) -> str | None:
        """The log line for the interval ending `now`, or None when the engine stayed idle."""
        elapsed_s = max(now - self._last_time, 1e-9)
        prompt_throughput = self._num_prompt_tokens / elapsed_s
        generation_throughput = self._num_generation_tokens / elapsed_s
        queries, hits = int(stats.get("prefix_cache_queries", 0)), int(stats.get("prefix_cache_hits", 0))
        interval_queries = queries - self._last_prefix_queries
        interval_hits = hits - self._last_prefix_hits
        if interval_queries > 0:
            hit_rate = interval_hits / interval_queries
        else:
            hit_rate = hits / queries if queries else 0.0
        running, waiting = int(stats.get("num_running_reqs", 0)), int(stats.get("num_waiting_reqs", 0))
        idle = not (self._num_prompt_tokens or self._num_generation_tokens or running or waiting)
        self._num_prompt_tokens = self._num_generation_tokens = 0
        self._last_time = now
        self._last_prefix_queries, self._last_prefix_hits = queries, hits
        if idle and self._logged_idle:
            return None
        self._logged_idle = idle
        return (
            f"Avg prompt throughput: {prompt_throughput:.1f} tokens/s, "
            f"Avg generation throughput: {generation_throughput:.1f} tokens/s, "
            f"Running: {running} reqs, Waiting: {waiting} reqs, "
            f"KV cache usage: {100 * float(stats.get('kv_cache_usage', 0.0)):.1f}%, "
            f"Prefix cache hit rate: {100 * hit_rate:.1f}%" + self._spec_decode_part(stats)
        )

    def _spec_decode_part(self, stats: dict[str, Any]) -> str:
        """ ", Draft acceptance rate: ..%, Mean accepted length: .." over the interval ("" without
        speculation or without drafts in the interval)."""
        if "spec_decode_num_drafts" not in stats:
            return ""
        now = (
            int(stats["spec_decode_num_drafts"]),
            int(stats["spec_decode_num_draft_tokens"]),
            int(stats["spec_decode_num_accepted_tokens"]),
        )
        drafts, draft_tokens, accepted = (a - b for a, b in zip(now, self._last_spec))
        self._last_spec = now
        if drafts <= 0 or draft_tokens <= 0:
            return ""
        return f", Draft acceptance rate: {100 * accepted / draft_tokens:.1f}%, Mean accepted length: {1 + accepted / drafts:.2f}"
