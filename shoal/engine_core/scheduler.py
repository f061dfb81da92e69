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

Pauses, sleeps, weight versions and worker restarts are `AdmissionControl`'s (admission.py):
`schedule` only reads `admission`. Requests with a grammar wait in the structured-output
manager until it is compiled; the manager names a step's structured rows and fills their
bitmask. A `KVConnector` (KV transfer), asked after the prefix cache, may load more of a prompt.
A step is a frozen `SchedulerOutput`: nothing changes it once it is built.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter, deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from shoal.config import CacheConfig, SchedulerConfig
from shoal.engine_core.admission import Admission, AdmissionControl
from shoal.engine_core.block_pool import KVCacheBlock
from shoal.engine_core.kv_cache_manager import KVCacheManager
from shoal.engine_core.lora_admission import LoRAAdmission
from shoal.engine_core.remote_kv import RemoteKVLoads
from shoal.engine_core.request import Request, RequestStatus
from shoal.engine_core.scheduled_step import ScheduledStep
from shoal.engine_core.speculation import SpeculativeConfig, SpeculativeScheduling
from shoal.kv_transfer.connector import tokens_to_load
from shoal.protocol import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from shoal.step import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput

__all__ = ["ScheduledStep", "Scheduler"]

if TYPE_CHECKING:
    from shoal.kv_transfer.connector import KVConnector
    from shoal.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class Scheduler(AdmissionControl, SpeculativeScheduling, LoRAAdmission, RemoteKVLoads):
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_kv_blocks: int,
        structured_output: StructuredOutputManager | None = None,
        samples_later: bool = False,
        kv_connector: KVConnector | None = None,
        speculative_config: SpeculativeConfig | None = None,
    ) -> None:
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.async_scheduling = scheduler_config.async_scheduling
        self.max_loras = scheduler_config.max_loras  # LoRA: adapters at once (lora_admission.py)
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
        self._init_admission()
        # Structured output: the grammars' manager, and whether the executor takes a step's
        # bitmask after its launch (`samples_later`: the step says it follows) or with the step.
        self.structured_output = structured_output
        self.samples_later = samples_later
        # Outputs of requests finished outside a step (a grammar that failed to compile).
        self._outputs_outside_steps: list[EngineCoreOutput] = []
        self.kv_connector = kv_connector  # KV transfer: None, nothing arrives from elsewhere
        self._init_remote_kv()  # requests parked while their KV loads (remote_kv.py)
        self._init_speculation(speculative_config)  # drafts a step carries (speculation.py)

    # ---- requests in and out ----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already running")
        if request.sampling_params.structured_outputs is None:
            self.waiting.append(request)
        elif self.structured_output is None:
            raise ValueError("this engine has no structured output")
        else:  # kept by the manager until its grammar is compiled (see `_admit_compiled`)
            self.structured_output.add_request(request)
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            if not self.samples_later:  # its step carries a bitmask that must have seen every token
                request.runs_ahead_from = sys.maxsize
        self.requests[request.request_id] = request

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_KV:
                self._unpark(request)  # (its load cancelled before its blocks are freed)
            elif request.status != RequestStatus.WAITING_FOR_GRAMMAR:  # (the manager forgets those)
                self.waiting.remove(request)
            request.status = RequestStatus.FINISHED_ABORTED
            self._free_request(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

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
        if self.structured_output is not None and self.structured_output.compiling:
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
            drafts = self._drafts_to_schedule(request, num_new_tokens, step.budget)
            blocks = self._allocate_or_preempt(request, num_new_tokens + len(drafts) + self.num_lookahead_slots)
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
            self._add_to_step(step, request, num_new_tokens + len(drafts))
            step.spec_tokens[request.request_id] = drafts
        return self.num_preemptions > num_preemptions_before

    def _schedule_waiting(self, step: ScheduledStep, started_only: bool = False) -> None:
        """Requests whose KV was loaded first, then waiting requests in arrival order, each
        starting after its prefix-cache hit, while the budget, the blocks and max_num_seqs
        allow; with `started_only`, only the preempted ones (they wait at the front)."""
        self._schedule_loaded(step)
        while self.waiting and step.budget > 0 and len(self.running) + self.num_parked < self.max_num_seqs:
            request = self._next_waiting()  # the head, unless its adapter must wait (max_loras)
            if request is None or (started_only and request.status != RequestStatus.PREEMPTED):
                break
            hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            # KV transfer: tokens after the hit whose KV can be loaded rather than computed.
            num_loaded_tokens = tokens_to_load(self.kv_connector, request, num_hit_tokens) if self.kv_connector else 0
            if num_loaded_tokens and self._loads_in_background(request):
                if self._park_for_kv(request, hit_blocks, num_hit_tokens, num_loaded_tokens):
                    continue  # parked: it starts once its KV is in (remote_kv.py)
                break
            num_computed_tokens = num_hit_tokens + num_loaded_tokens
            num_new_tokens = min(request.num_tokens - num_computed_tokens, step.budget)
            num_slots = num_loaded_tokens + num_new_tokens + self.num_lookahead_slots
            if self.kv_cache_manager.allocate_slots(request, num_slots, hit_blocks, num_hit_tokens) is None:
                break
            self.waiting.remove(request)
            self._start(step, request, num_computed_tokens, num_new_tokens)
            if num_loaded_tokens:  # copied in before the step runs
                self._load_with_step(request, num_hit_tokens, num_loaded_tokens)

    def _start(self, step: ScheduledStep, request: Request, num_computed_tokens: int, num_new_tokens: int) -> None:
        """A request whose blocks are allocated runs (again): the workers get it whole."""
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed_tokens
            request.first_scheduled_time = time.time()
        request.num_output_tokens_sent = request.num_output_tokens
        new_req = NewRequestData(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            sampling_params=request.sampling_params,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            num_computed_tokens=num_computed_tokens,
            eos_token_id=request.eos_token_id,
            lora_name=request.lora_name,
        )
        step.new_reqs.append(new_req)
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
        request.spec_token_ids = []
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
        structured = self.structured_output
        structured_req_ids = structured.sampling_rows(step.requests) if structured and structured.requests else []
        # Their bitmask follows the step where the executor takes it after the launch (the engine
        # core asks the manager for it then); else the step carries it, filled now (see add_request).
        carried = structured is not None and bool(structured_req_ids) and not self.samples_later
        return SchedulerOutput(
            new_reqs=step.new_reqs,
            cached_reqs=step.cached_reqs,
            num_scheduled_tokens=step.num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_batched_tokens - step.budget,
            finished_req_ids=finished_req_ids,
            step_id=self._step_id,
            structured_req_ids=structured_req_ids,
            grammar=structured.grammar_bitmask(structured_req_ids, step.spec_tokens)
            if carried and structured
            else None,
            grammar_follows=self.samples_later and bool(structured_req_ids),
            scheduled_spec_decode_tokens={r: drafts for r, drafts in step.spec_tokens.items() if drafts},
        )

    # ---- structured output ------------------------------------------------------------------

    def _admit_compiled(self) -> None:
        """Requests whose grammar is compiled join the waiting queue; one whose grammar failed
        finishes (aborted, with the reason as its stop reason)."""
        assert self.structured_output is not None
        ready, failed = self.structured_output.take_compiled()
        for request in ready:
            request.status = RequestStatus.WAITING
            self.waiting.append(request)
        for request in failed:
            assert request.structured_output is not None
            request.status, request.stop_reason = RequestStatus.FINISHED_ABORTED, request.structured_output.error
            self._outputs_outside_steps.append(
                EngineCoreOutput(request.request_id, [], finish_reason="abort", stop_reason=request.stop_reason)
            )
            self._free_request(request)

    def take_outputs_outside_steps(self) -> list[EngineCoreOutput]:
        outputs, self._outputs_outside_steps = self._outputs_outside_steps, []
        return outputs

    # ---- results of a step ------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Append the sampled tokens, finish requests that stopped, and report to the frontend."""
        step = self._scheduled.pop(scheduler_output.step_id, None) or ScheduledStep(0, self.weight_version)
        scheduled = self._land(step)
        prompt_chunks = {r: chunk for r, chunk in step.prompt_chunks.items() if r in scheduled}
        outputs, num_generation_tokens = self._append_sampled(model_output, scheduled, step)
        self._take_new_drafts(model_output, scheduled)
        if self.structured_output is not None and self.structured_output.requests:
            self.structured_output.accept_outputs(outputs)
        if self._outputs_outside_steps:
            outputs.extend(self.take_outputs_outside_steps())
        num_prompt_tokens = sum(num_tokens for _, num_tokens in prompt_chunks.values())
        stats = self.make_stats(num_prompt_tokens=num_prompt_tokens, num_generation_tokens=num_generation_tokens)
        return EngineCoreOutputs(
            outputs=outputs, scheduler_stats=stats, timestamp=time.time(), weight_version=step.weight_version
        )

    def _append_sampled(
        self, model_output: ModelRunnerOutput, scheduled: dict[str, Request], step: ScheduledStep
    ) -> tuple[list[EngineCoreOutput], int]:
        """Each request's sampled tokens, up to the one that stops it (finished requests are
        freed); the outputs for the frontend, and how many tokens were accepted."""
        outputs = []
        num_generation_tokens = 0
        # Usually empty: only requests that asked for them have (prompt) logprobs.
        all_prompt_logprobs, all_logprobs = model_output.prompt_logprobs, model_output.logprobs
        for request_id, token_ids in zip(model_output.req_ids, model_output.sampled_token_ids, strict=True):
            request = scheduled.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted, or finished by an earlier step, while this step ran
            new_token_ids, finished = self._append_emitted(request, token_ids, step.spec_tokens.get(request_id))
            num_generation_tokens += len(new_token_ids)
            prompt_logprobs = all_prompt_logprobs.get(request_id) if all_prompt_logprobs else None
            if prompt_logprobs is not None:
                prompt_logprobs = request.take_unsent_prompt_logprobs(
                    prompt_logprobs, step.prompt_chunks[request_id][0]
                )
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
        return outputs, num_generation_tokens

    def _land(self, step: ScheduledStep) -> dict[str, Request]:
        """The step is back: its requests are no longer in flight. Returns those still as they
        were when it was built (not aborted or finished since)."""
        scheduled = {}
        for request_id, request in step.requests.items():
            request.num_steps_in_flight -= 1
            if self.requests.get(request_id) is request:
                scheduled[request_id] = request
        return scheduled

    def _free_request(self, request: Request) -> None:
        if request.structured_output is not None:
            assert self.structured_output is not None
            self.structured_output.remove_request(request)
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_req_ids.append(request.request_id)

    # ---- statistics and cache control -------------------------------------------------------

    def make_stats(self, num_prompt_tokens: int = 0, num_generation_tokens: int = 0) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            num_deferred_reqs=self.num_parked + len(self.structured_output.compiling if self.structured_output else ()),
            kv_cache_usage=kv.usage(),
            num_used_blocks=kv.block_pool.num_used_blocks,
            prefix_cache_queries=kv.prefix_cache_stats.queries,
            prefix_cache_hits=kv.prefix_cache_stats.hits,
            num_preemptions=self.num_preemptions,
            num_prompt_tokens=num_prompt_tokens,
            num_generation_tokens=num_generation_tokens,
            **self.lora_stats(),
        )

    def reset_prefix_cache(self) -> bool:
        self.kv_cache_manager.reset_prefix_cache()
        return True
