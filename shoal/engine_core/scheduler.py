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

Scheduling can be held (`admission`): by a pause (`pause`, as `EngineCore.pause_generation`
asks), while the engine sleeps, and while weights discarded by a level-2 sleep have not been
replaced. A "wait" pause lets the requests already started run to their end and admits no new
one; the other holds schedule nothing. Requests that arrive meanwhile wait. Every step is stamped
with the weight version it runs with (`weight_version`), which its outputs carry to the frontend.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from shoal.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")


class Admission(enum.Enum):
    """What `Scheduler.schedule` may schedule."""

    OPEN = "open"  # every request
    DRAIN = "drain"  # only requests already started (a "wait" pause)
    HOLD = "hold"  # nothing (paused, asleep, or weights discarded)


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


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_kv_blocks: int,
        structured_output: StructuredOutputManager | None = None,
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
        # The steps still executing, by step id (pipeline parallelism and async scheduling keep
        # several in flight).
        self._scheduled: dict[int, ScheduledStep] = {}
        self.num_preemptions = 0
        # The version of the weights that steps scheduled from now on run with: "0" at start,
        # advanced by every weight update (see `advance_weight_version`).
        self.weight_version = "0"
        self._num_weight_updates = 0
        # Why scheduling is held, if it is (see `_update_admission`).
        self.pause_mode: str | None = None
        self.sleeping = False
        self.weights_missing = False  # discarded by a level-2 sleep (or half updated), not yet replaced
        self.admission = Admission.OPEN
        # Structured output: the grammars' manager, the requests whose grammar is still being
        # compiled (kept out of `waiting`, so they hold up no one), how many requests with a
        # grammar are unfinished (0: every structured-output path is skipped), and outputs of
        # requests finished outside a step (a grammar that failed to compile).
        self.structured_output = structured_output
        self.waiting_for_grammar: list[Request] = []
        self.num_structured_requests = 0
        self._outputs_outside_steps: list[EngineCoreOutput] = []

    # ---- requests in and out ----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already running")
        self.requests[request.request_id] = request
        if request.sampling_params.structured_outputs is not None:
            if self.structured_output is None:
                raise ValueError("this engine has no structured output")
            self.structured_output.add_request(request)
            self.num_structured_requests += 1
            self.waiting_for_grammar.append(request)
            return
        self.waiting.append(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request in self.waiting_for_grammar:
                self.waiting_for_grammar.remove(request)
            else:
                self.waiting.remove(request)
            request.status = RequestStatus.FINISHED_ABORTED
            self._free_request(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Whether `schedule` may have something to run: any request while admission is open;
        under a "wait" pause only requests already started (running, or preempted: those wait
        at the front of the queue); nothing while held."""
        if self.admission is Admission.OPEN:
            return bool(self.requests)
        return self.admission is Admission.DRAIN and self.has_started_requests()

    def has_started_requests(self) -> bool:
        """Whether a request that has started generating is unfinished: running, or preempted
        (preempted requests wait at the front of the queue)."""
        return bool(self.running) or bool(self.waiting and self.waiting[0].status == RequestStatus.PREEMPTED)

    def has_schedulable_requests(self) -> bool:
        if self.admission is not Admission.OPEN and not self.has_work():
            return False
        if self.async_scheduling:
            return bool(self.requests)  # requests in flight may run ahead
        return any(not request.num_steps_in_flight for request in self.requests.values())

    @property
    def in_flight(self) -> Counter[str]:
        """Request id → how many steps still executing include it."""
        return Counter(
            request_id
            for step in self._scheduled.values()
            for request_id, request in step.requests.items()
            if self.requests.get(request_id) is request
        )

    # ---- one step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self.waiting_for_grammar:
            self._admit_compiled()
        step = ScheduledStep(budget=self.max_num_batched_tokens, weight_version=self.weight_version)
        if self.admission is not Admission.OPEN:
            return self._schedule_held(step)
        preempted = self._schedule_running(step)
        # New requests only when no running one had to give up its blocks this step.
        if not preempted:
            self._schedule_waiting(step)
        return self._make_output(step)

    def _schedule_held(self, step: ScheduledStep) -> SchedulerOutput:
        """Nothing while held; while draining, the running requests and the preempted ones."""
        if self.admission is Admission.DRAIN and not self._schedule_running(step):
            self._schedule_waiting(step, started_only=True)
        return self._make_output(step)

    def _schedule_running(self, step: ScheduledStep) -> bool:
        """Running requests in order, each as many tokens as it has to compute and the budget
        leaves; True when one had to be preempted to make room."""
        num_preemptions_before = self.num_preemptions
        index = 0
        while index < len(self.running) and step.budget > 0:
            request = self.running[index]
            index += 1
            if request.num_steps_in_flight and not self._may_run_ahead(request):
                continue
            num_new_tokens = min(self._num_tokens_to_compute(request), step.budget)
            if num_new_tokens == 0:
                continue
            blocks = self._allocate_or_preempt(request, num_new_tokens)
            if blocks is None:
                break  # the request itself was preempted, or nothing could give way
            step.cached_reqs.append(
                CachedRequestData(
                    req_id=request.request_id,
                    new_token_ids=request.take_unsent_output_token_ids(),
                    new_block_ids=[b.block_id for b in blocks],
                    num_computed_tokens=request.num_computed_tokens,
                )
            )
            self._add_to_step(step, request, num_new_tokens)
        return self.num_preemptions > num_preemptions_before

    def _schedule_waiting(self, step: ScheduledStep, started_only: bool = False) -> None:
        """Waiting requests in arrival order, each starting after its prefix-cache hit, while
        the budget, the blocks and max_num_seqs allow; with `started_only`, only the preempted
        ones (they wait at the front)."""
        while self.waiting and step.budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if started_only and request.status != RequestStatus.PREEMPTED:
                break
            hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_new_tokens = min(request.num_tokens - num_hit_tokens, step.budget)
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
            request.num_output_tokens_sent = request.num_output_tokens
            step.new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=request.output_token_ids,
                    sampling_params=request.sampling_params,
                    block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                    num_computed_tokens=num_hit_tokens,
                    eos_token_id=request.eos_token_id,
                )
            )
            self._add_to_step(step, request, num_new_tokens)

    @staticmethod
    def _add_to_step(step: ScheduledStep, request: Request, num_new_tokens: int) -> None:
        """The request computes `num_new_tokens` more tokens in this step. They count as
        computed from now on (their KV is written this step), and the request is in flight
        until the step's output is applied. A step that reaches past the known tokens samples
        one more: a placeholder until it is back."""
        step.num_scheduled_tokens[request.request_id] = num_new_tokens
        step.requests[request.request_id] = request
        step.budget -= num_new_tokens
        start = request.num_computed_tokens
        if start < request.num_prompt_tokens:  # a prefill chunk, not a decode or a recompute
            step.prompt_chunks[request.request_id] = (start, min(num_new_tokens, request.num_prompt_tokens - start))
        request.num_computed_tokens = start + num_new_tokens
        request.num_steps_in_flight += 1
        if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
            request.num_output_placeholders += 1

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

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int) -> list[KVCacheBlock] | None:
        """Allocate the request's new slots, preempting the newest running requests until they
        fit; None when the request itself was preempted or no request could give way."""
        while True:
            blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if blocks is not None:
                return blocks
            victim = self._newest_preemptible()
            if victim is None:
                return None
            self.running.remove(victim)
            self._preempt(victim)
            if victim is request:
                return None

    def _newest_preemptible(self) -> Request | None:
        """The newest running request not in flight: neither scheduled in this step nor still
        executing an earlier one (its output must come back before it may be rebuilt)."""
        for request in reversed(self.running):
            if not request.num_steps_in_flight:
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

    def _make_output(self, step: ScheduledStep) -> SchedulerOutput:
        self._step_id += 1
        # An empty step is not executed, so the workers hear of finished requests with the next
        # step that runs.
        finished_req_ids: list[str] = []
        if step.num_scheduled_tokens:
            finished_req_ids, self._finished_req_ids = self._finished_req_ids, []
            self._scheduled[self._step_id] = step
        return SchedulerOutput(
            new_reqs=step.new_reqs,
            cached_reqs=step.cached_reqs,
            num_scheduled_tokens=step.num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_batched_tokens - step.budget,
            finished_req_ids=finished_req_ids,
            step_id=self._step_id,
            structured_req_ids=self._structured_samplers(step) if self.num_structured_requests else [],
        )

    # ---- structured output ------------------------------------------------------------------

    def _admit_compiled(self) -> None:
        """Requests whose grammar is compiled join the waiting queue; one whose grammar failed
        finishes (aborted, with the reason as its stop reason)."""
        still_compiling = []
        for request in self.waiting_for_grammar:
            grammar = request.structured_output
            assert grammar is not None
            if not grammar.start():
                still_compiling.append(request)
            elif grammar.error is None:
                self.waiting.append(request)
            else:
                logger.error("request %s: its grammar did not compile: %s", request.request_id, grammar.error)
                request.status, request.stop_reason = RequestStatus.FINISHED_ABORTED, grammar.error
                self._outputs_outside_steps.append(
                    EngineCoreOutput(request.request_id, [], finish_reason="abort", stop_reason=grammar.error)
                )
                self._free_request(request)
        self.waiting_for_grammar = still_compiling

    @staticmethod
    def _structured_samplers(step: ScheduledStep) -> list[str]:
        """The step's requests with a grammar that sample a token in it (their prompt, or the
        chunk of it, is complete), in batch order."""
        return [
            request_id
            for request_id, request in step.requests.items()
            if request.structured_output is not None and request.num_computed_tokens >= request.num_tokens
        ]

    def structured_requests(self, scheduler_output: SchedulerOutput) -> list[Request]:
        """The requests of `scheduler_output.structured_req_ids` that are still running."""
        step = self._scheduled.get(scheduler_output.step_id)
        if step is None:
            return []
        requests = (step.requests[r] for r in scheduler_output.structured_req_ids)
        return [r for r in requests if self.requests.get(r.request_id) is r and not r.is_finished]

    def take_outputs_outside_steps(self) -> list[EngineCoreOutput]:
        outputs, self._outputs_outside_steps = self._outputs_outside_steps, []
        return outputs

    def _advance_matchers(self, outputs: list[EngineCoreOutput], scheduled: dict[str, Request]) -> None:
        """Feed the tokens this step accepted to the unfinished requests' grammars."""
        for output in outputs:
            request = scheduled.get(output.request_id)
            grammar = request.structured_output if request is not None else None
            if grammar is None or output.finished or grammar.matcher is None:
                continue
            if not grammar.accept(output.new_token_ids):
                logger.error(
                    "request %s: its grammar refused a sampled token %s", output.request_id, output.new_token_ids
                )

    # ---- results of a step ------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Append the sampled tokens, finish requests that stopped, and report to the frontend."""
        outputs = []
        step = self._scheduled.pop(scheduler_output.step_id, None) or ScheduledStep(0, self.weight_version)
        scheduled = self._land(step)
        prompt_chunks = {r: chunk for r, chunk in step.prompt_chunks.items() if r in scheduled}
        num_prompt_tokens = sum(num_tokens for _, num_tokens in prompt_chunks.values())
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
                prompt_logprobs = self._unsent_prompt_logprobs(request, prompt_logprobs, prompt_chunks[request_id][0])
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
        if self.num_structured_requests:
            self._advance_matchers(outputs, scheduled)
        if self._outputs_outside_steps:
            outputs.extend(self.take_outputs_outside_steps())
        stats = self.make_stats(num_prompt_tokens=num_prompt_tokens, num_generation_tokens=num_generation_tokens)
        return EngineCoreOutputs(
            outputs=outputs, scheduler_stats=stats, timestamp=time.time(), weight_version=step.weight_version
        )

    def _land(self, step: ScheduledStep) -> dict[str, Request]:
        """The step is back: its requests are no longer in flight. Returns those still as they
        were when it was built (not aborted or finished since)."""
        scheduled = {}
        for request_id, request in step.requests.items():
            request.num_steps_in_flight -= 1
            if self.requests.get(request_id) is request:
                scheduled[request_id] = request
        return scheduled

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
        if request.structured_output is not None:
            self.num_structured_requests -= 1
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_req_ids.append(request.request_id)

    # ---- statistics and cache control -------------------------------------------------------

    def make_stats(self, num_prompt_tokens: int = 0, num_generation_tokens: int = 0) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            num_deferred_reqs=len(self.waiting_for_grammar),
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

    # ---- recovery from a worker's death -----------------------------------------------------

    def requeue_for_recompute(self) -> int:
        """The workers lost their state (one was re-created; every rank starts over with an
        empty batch and a KV cache of unknown content): forget the steps in flight, whose output
        will never come, and preempt every running request by recompute. Output tokens already
        sampled stay; a requeued request computes its prompt and them again, then samples the
        next. Returns how many requests were requeued."""
        for step in self._scheduled.values():
            for request in step.requests.values():
                request.num_steps_in_flight -= 1
        self._scheduled.clear()
        num_requeued = len(self.running)
        self.preempt_all_running()  # (which drops their placeholders too)
        # No worker knows any request now; there is nothing to tell them about finished ones.
        self._finished_req_ids.clear()
        self.reset_prefix_cache()
        return num_requeued

    @property
    def weights_updated_in_place(self) -> bool:
        """Whether weights were updated since they were loaded (a re-created worker, which
        loads the checkpoint, would not run them)."""
        return self._num_weight_updates > 0

    def advance_weight_version(self, name: str | None = None) -> str:
        """New weights are in: later steps run with version `name`, or by default with the
        number of updates so far ("1", "2", ...). Returns the new version. Weights discarded by a
        level-2 sleep count as replaced from now on."""
        self._num_weight_updates += 1
        self.weight_version = str(self._num_weight_updates) if name is None else name
        if self.weights_missing:
            self.weights_missing = False
            self._update_admission()
        return self.weight_version

    def hold_for_weight_update(self) -> None:
        """An update in several calls has begun: hold scheduling until its last call (which
        advances the weight version), so that no step runs with half-written weights."""
        self.weights_missing = True
        self._update_admission()

    # ---- pause and sleep ----------------------------------------------------------------------
    # The engine core lands every step still in flight before it calls these (except a "wait"
    # pause, whose requests go on running), so no request is in flight here.

    def pause(self, mode: str, clear_cache: bool = True) -> list[EngineCoreOutput]:
        """Hold scheduling until `resume`. "abort" finishes every request (running and waiting)
        as aborted and returns their final outputs; "wait" lets the requests already started
        run to their end; "keep" freezes them. With `clear_cache` the prefix cache is reset, and
        kept requests give up their KV cache (recomputed after `resume`, with the weights in
        place then)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        outputs = self._abort_all() if mode == "abort" else []
        if mode == "keep" and clear_cache:
            self.preempt_all_running()
        if clear_cache:
            self.reset_prefix_cache()
        self.pause_mode = mode
        self._update_admission()
        return outputs

    def resume(self) -> None:
        self.pause_mode = None
        self._update_admission()

    def sleep(self, discard_weights: bool) -> None:
        """The workers are about to drop the KV cache (and with `discard_weights` the weights):
        running requests give up their blocks and wait to be recomputed after the wake-up, and
        the prefix cache forgets every block. Scheduling is held until `wake_up` (and, with
        `discard_weights`, until `advance_weight_version`)."""
        self.preempt_all_running()
        self.reset_prefix_cache()
        self.sleeping = True
        self.weights_missing = self.weights_missing or discard_weights
        self._update_admission()

    def wake_up(self) -> None:
        self.sleeping = False
        self._update_admission()

    def preempt_all_running(self) -> None:
        """Every running request gives up its KV blocks and waits, in its order, at the front
        of the queue, to be recomputed with its tokens so far."""
        if any(request.num_steps_in_flight for request in self.running):
            raise RuntimeError("requests still in flight cannot give up their blocks: land their steps first")
        for request in reversed(self.running):
            self._preempt(request)
        self.running = []

    def _abort_all(self) -> list[EngineCoreOutput]:
        """Abort every request; their final outputs (no new tokens, finish_reason "abort")."""
        outputs = [
            EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason="abort",
                num_cached_tokens=max(request.num_cached_tokens, 0),
                first_scheduled_time=request.first_scheduled_time,
            )
            for request in self.requests.values()
        ]
        self.abort_requests(list(self.requests))
        return outputs

    def _update_admission(self) -> None:
        if self.sleeping or self.weights_missing or self.pause_mode in ("abort", "keep"):
            self.admission = Admission.HOLD
        elif self.pause_mode == "wait":
            self.admission = Admission.DRAIN
        else:
            self.admission = Admission.OPEN
