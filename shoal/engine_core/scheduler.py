"""`Scheduler`: continuous batching under one token budget per step.

A step is a map request → number of tokens to compute. Running requests come first (decodes
need one token; a prompt being prefilled in chunks takes what the budget leaves), then waiting
requests in arrival order, starting after their prefix-cache hit. A prompt longer than the
budget is chunked across steps. When the KV cache runs out of blocks, the newest running
request is preempted: its blocks are freed and it waits to be recomputed from scratch.

Steps may overlap. With pipeline parallelism a request waits until its step comes back; with
async scheduling a decoding request runs one step ahead: it is scheduled again while its last
token is still being sampled (a placeholder the workers fill in on the device), so the next
step is ready when the device finishes this one.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Iterable

from shoal.config import CacheConfig, SchedulerConfig
from shoal.engine_core.batch import (
    CachedRequestData,
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from shoal.engine_core.block_pool import KVCacheBlock
from shoal.engine_core.kv_cache_manager import KVCacheManager
from shoal.engine_core.request import Request, RequestStatus
from shoal.protocol import EngineCoreOutput, EngineCoreOutputs, SchedulerStats

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_kv_blocks: int,
    ) -> None:
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.async_scheduling = scheduler_config.async_scheduling
        self.kv_cache_manager = KVCacheManager(
            num_kv_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_req_ids: list[str] = []
        self._step_id = 0
        # The requests each step still executing was built for, by step id (pipeline parallelism
        # and async scheduling keep several steps in flight): an output must reach the request it
        # was computed for, not a new one that reuses an aborted request's id.
        self._scheduled: dict[int, dict[str, Request]] = {}
        self.num_preemptions = 0

    # ---- requests in and out ----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already running")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = RequestStatus.FINISHED_ABORTED
            self._free_request(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_schedulable_requests(self) -> bool:
        if self.async_scheduling:
            return bool(self.requests)  # requests in flight may run ahead
        return not all(self._is_in_flight(request) for request in self.requests.values())

    def _is_in_flight(self, request: Request) -> bool:
        """Whether a step still executing includes this request."""
        # A loop rather than any(generator): it runs for every request of every step, and the
        # generator costs more than the one or two steps it walks (benchmarks/bench_scheduler.py).
        for step in self._scheduled.values():  # noqa: SIM110
            if step.get(request.request_id) is request:
                return True
        return False

    @property
    def in_flight(self) -> Counter[str]:
        """Request id → how many steps still executing include it."""
        return Counter(
            request_id
            for step in self._scheduled.values()
            for request_id, request in step.items()
            if self.requests.get(request_id) is request
        )

    # ---- one step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_blocks: dict[str, list[int]] = {}
        scheduled_new: list[Request] = []
        num_preemptions_before = self.num_preemptions

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if self._is_in_flight(request) and not self._may_run_ahead(request):
                index += 1
                continue
            num_new_tokens = min(self._num_tokens_to_compute(request), budget)
            if num_new_tokens == 0:
                index += 1
                continue
            blocks = self._allocate_or_preempt(request, num_new_tokens, num_scheduled)
            if blocks is None:
                break  # the request itself was preempted, or nothing could give way
            num_scheduled[request.request_id] = num_new_tokens
            new_blocks[request.request_id] = [b.block_id for b in blocks]
            budget -= num_new_tokens
            index += 1

        # New requests only when no running one had to give up its blocks this step.
        preempted = self.num_preemptions > num_preemptions_before
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_new_tokens = min(request.num_tokens - num_hit_tokens, budget)
            blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens, hit_blocks, num_hit_tokens)
            if blocks is None:
                break
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
                request.first_scheduled_time = time.time()
            num_scheduled[request.request_id] = num_new_tokens
            scheduled_new.append(request)
            budget -= num_new_tokens

        return self._make_output(num_scheduled, new_blocks, scheduled_new)

    def _num_tokens_to_compute(self, request: Request) -> int:
        return request.num_tokens + request.num_output_placeholders - request.num_computed_tokens

    def _may_run_ahead(self, request: Request) -> bool:
        """Async scheduling: may this request, still in flight, be scheduled again? Not when
        its sampler needs its latest tokens on the host (penalties count them, min_tokens
        masks by their number), nor when the tokens in flight already end it by length."""
        if not self.async_scheduling:
            return False
        num_output, num_pending = request.num_output_tokens, request.num_output_placeholders
        return (
            num_output >= request.runs_ahead_from
            and num_output + num_pending < request.max_tokens
            and request.num_tokens + num_pending < self.max_model_len
        )

    def _allocate_or_preempt(
        self, request: Request, num_new_tokens: int, num_scheduled: dict[str, int]
    ) -> list[KVCacheBlock] | None:
        """Allocate the request's new slots, preempting the newest running requests until they
        fit; None when the request itself was preempted or no request could give way."""
        while True:
            blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if blocks is not None:
                return blocks
            victim = self._newest_preemptible(num_scheduled)
            if victim is None:
                return None
            self.running.remove(victim)
            self._preempt(victim)
            if victim is request:
                return None

    def _newest_preemptible(self, num_scheduled: dict[str, int]) -> Request | None:
        """The newest running request that is neither scheduled in this step (`num_scheduled`)
        nor still executing an earlier one (its output must come back before it may be rebuilt)."""
        for request in reversed(self.running):
            if request.request_id not in num_scheduled and not self._is_in_flight(request):
                return request
        return None

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # never set: requests in flight are not preempted
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        self._finished_req_ids.append(request.request_id)
        logger.debug("preempted %s", request.request_id)

    def _make_output(
        self,
        num_scheduled: dict[str, int],
        new_blocks: dict[str, list[int]],
        scheduled_new: list[Request],
    ) -> SchedulerOutput:
        cached_reqs = []
        for request_id, block_ids in new_blocks.items():
            request = self.requests[request_id]
            cached_reqs.append(
                CachedRequestData(
                    req_id=request_id,
                    new_token_ids=request.take_unsent_output_token_ids(),
                    new_block_ids=block_ids,
                    num_computed_tokens=request.num_computed_tokens,
                )
            )
        new_reqs = []
        for request in scheduled_new:
            request.num_output_tokens_sent = request.num_output_tokens
            new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=request.output_token_ids,
                    sampling_params=request.sampling_params,
                    block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                    num_computed_tokens=request.num_computed_tokens,
                    eos_token_id=request.eos_token_id,
                )
            )
        self._step_id += 1
        # An empty step is not executed, so the workers hear of finished requests with the next
        # step that runs.
        finished_req_ids: list[str] = []
        if num_scheduled:
            finished_req_ids, self._finished_req_ids = self._finished_req_ids, []
        output = SchedulerOutput(
            new_reqs=new_reqs,
            cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=finished_req_ids,
            step_id=self._step_id,
        )
        if num_scheduled:
            self._scheduled[self._step_id] = {request_id: self.requests[request_id] for request_id in num_scheduled}
        # The scheduled tokens count as computed from now on: their KV is written this step. A
        # step that reaches past the known tokens samples one more: a placeholder until it is back.
        for request_id, num_tokens in num_scheduled.items():
            request = self.requests[request_id]
            request.num_computed_tokens += num_tokens
            if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1
        return output

    # ---- results of a step ------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Append the sampled tokens, finish requests that stopped, and report to the frontend."""
        outputs = []
        # Requests still as they were when the step was built (not aborted or finished since).
        scheduled = {
            request_id: request
            for request_id, request in self._scheduled.pop(scheduler_output.step_id, {}).items()
            if self.requests.get(request_id) is request
        }
        step_starts = _step_starts(scheduler_output)
        num_prompt_tokens = self._num_prompt_tokens_computed(scheduler_output, scheduled, step_starts)
        num_generation_tokens = 0
        # Usually empty: only requests that asked for them have (prompt) logprobs.
        all_prompt_logprobs, all_logprobs = model_output.prompt_logprobs, model_output.logprobs
        for request_id, token_ids in zip(model_output.req_ids, model_output.sampled_token_ids, strict=True):
            request = scheduled.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted, or finished by an earlier step, while this step ran
            if token_ids:
                request.num_output_placeholders -= 1
            new_token_ids = []
            finished = False
            for token_id in token_ids:
                request.append_output_token_id(token_id)
                new_token_ids.append(token_id)
                finished = self._check_stop(request)
                if finished:
                    break
            num_generation_tokens += len(new_token_ids)
            prompt_logprobs = all_prompt_logprobs.get(request_id) if all_prompt_logprobs else None
            if prompt_logprobs is not None:
                prompt_logprobs = self._unsent_prompt_logprobs(request, prompt_logprobs, step_starts[request_id])
            if not new_token_ids and prompt_logprobs is None:
                continue
            logprobs = all_logprobs.get(request_id) if all_logprobs else None
            outputs.append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=logprobs.slice(0, len(new_token_ids)) if logprobs else None,
                    new_prompt_logprobs=prompt_logprobs,
                    finish_reason=request.finish_reason if finished else None,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    first_scheduled_time=request.first_scheduled_time if finished else None,
                )
            )
            if finished:
                self.running.remove(request)
                self._free_request(request)
        stats = self.make_stats(num_prompt_tokens=num_prompt_tokens, num_generation_tokens=num_generation_tokens)
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=stats, timestamp=time.time())

    def _num_prompt_tokens_computed(
        self, scheduler_output: SchedulerOutput, scheduled: dict[str, Request], step_starts: dict[str, int]
    ) -> int:
        """How many of the step's tokens were prompt positions."""
        total = 0
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = scheduled.get(request_id)
            if request is None:
                continue  # aborted while the step ran
            start = step_starts[request_id]
            if start < request.num_prompt_tokens:  # a prefill chunk, not a decode or a recompute
                total += min(num_tokens, request.num_prompt_tokens - start)
        return total

    def _unsent_prompt_logprobs(self, request: Request, rows: LogprobsLists, start: int) -> LogprobsLists | None:
        """The rows of prompt positions the frontend has not had yet. Row i is prompt position
        `start + i`; after a preemption the prompt is computed again from position 0, and its
        rows come again."""
        num_sent, num_rows = request.num_prompt_logprobs_sent, len(rows.ranks)
        request.num_prompt_logprobs_sent = max(num_sent, start + num_rows)
        if start + num_rows <= num_sent:
            return None
        return rows.slice(num_sent - start, num_rows) if start < num_sent else rows

    def _check_stop(self, request: Request) -> bool:
        """Finish the request if its last token ends it; True when it did."""
        params = request.sampling_params
        last = request.all_token_ids[-1]
        num_output_tokens = request.num_output_tokens
        if num_output_tokens >= params.min_tokens:
            if last == request.eos_token_id and not params.ignore_eos:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = last
                return True
        if num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_req_ids.append(request.request_id)

    # ---- statistics and cache control -------------------------------------------------------

    def make_stats(self, num_prompt_tokens: int = 0, num_generation_tokens: int = 0) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage(),
            num_used_blocks=kv.block_pool.num_used_blocks,
            prefix_cache_queries=kv.prefix_cache_stats.queries,
            prefix_cache_hits=kv.prefix_cache_stats.hits,
            num_preemptions=self.num_preemptions,
            num_prompt_tokens=num_prompt_tokens,
            num_generation_tokens=num_generation_tokens,
        )

    def reset_prefix_cache(self) -> bool:
        self.kv_cache_manager.reset_prefix_cache()
        return True


def _step_starts(scheduler_output: SchedulerOutput) -> dict[str, int]:
    """Each scheduled request's computed tokens before the step (its first position in it)."""
    starts = {new.req_id: new.num_computed_tokens for new in scheduler_output.new_reqs}
    starts.update((cached.req_id, cached.num_computed_tokens) for cached in scheduler_output.cached_reqs)
    return starts
