"""`EngineCore`: the loop at the heart of shoal — schedule → execute → update.

It owns the scheduler and the executor. This class is the in-process core; the engine-core
process wraps it with socket threads (see `engine_core/process.py`). Pause/resume and
sleep/wake_up come from `GenerationControl` (engine_core/generation_control.py), the weight
updates from `WeightUpdateControl` (engine_core/weight_updates.py).

When a Ray worker dies the executor says so with `WorkerDiedError`; the core then requeues the
running requests for recompute, has the executor re-create the worker, and carries on, as long as
`max_worker_restarts` allows (see `recover_from_worker_death` and docs/fault_tolerance.md).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec

from shoal.config import EngineConfig
from shoal.engine_core.generation_control import GenerationControl
from shoal.engine_core.lora_control import LoRAControl
from shoal.engine_core.request import Request
from shoal.engine_core.routed_experts import attach_routed_experts
from shoal.engine_core.scheduler import Scheduler
from shoal.engine_core.weight_updates import WeightUpdateControl
from shoal.engine_core.worker_restarts import RestartBudget
from shoal.errors import EngineDeadError, WorkerDiedError
from shoal.executors.abstract import Executor, StepFuture
from shoal.kv_events.publisher import make_event_publisher
from shoal.kv_transfer.host_tier import host_tier_stats, start_host_tier
from shoal.kv_transfer.pd_connector import start_kv_transfer
from shoal.protocol import EngineCoreOutputs, EngineCoreRequest
from shoal.step import SchedulerOutput

logger = logging.getLogger(__name__)

# How long an engine with nothing to run but grammars being compiled waits for one.
_GRAMMAR_POLL_S = 0.005
# How long an engine with nothing to run but KV being loaded waits for a load to end.
_KV_LOAD_POLL_S = 0.005


@dataclass
class StepTimes:
    """Cumulative wall time of the executed steps, and how much of it the workers took; the
    rest is the engine's own work per step (scheduling and applying outputs)."""

    num_steps: int = 0
    total_s: float = 0.0
    execute_s: float = 0.0

    def record(self, total_s: float, execute_s: float) -> None:
        self.num_steps += 1
        self.total_s += total_s
        self.execute_s += execute_s


class EngineCore(GenerationControl, WeightUpdateControl, LoRAControl):
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        self.config = config
        start = time.perf_counter()
        # KV-cache events (shoal/kv_events/): collected by the block pool, published once a step.
        # First, so that an endpoint that cannot be bound fails before the model loads.
        self.kv_events = make_event_publisher(config.kv_events_config)
        self.executor = executor if executor is not None else Executor.create(config)
        num_kv_blocks = self.executor.initialize_kv_cache()
        self._check_capacity(num_kv_blocks)
        self.num_kv_blocks = num_kv_blocks
        from shoal.structured_output.manager import StructuredOutputManager

        self.structured_output = StructuredOutputManager(config.model_config)
        self.scheduler = Scheduler(
            config.scheduler_config,
            config.cache_config,
            num_kv_blocks,
            structured_output=self.structured_output,
            # Speculation verifies and drafts within the step: its bitmask comes with it.
            samples_later=self.executor.samples_later and config.speculative_config is None,
            speculative_config=config.speculative_config,
        )
        # The host-memory tier under the prefix cache (--kv-offload-bytes), the scheduler's connector.
        self.host_tier = start_host_tier(config, self.executor, self.scheduler)
        # Prefill/decode disaggregation (kv_transfer_role): saves after prefills, loads in the background.
        self.kv_transfer = start_kv_transfer(config, self.executor, self.scheduler, inner=self.host_tier)
        # A launched step whose bitmask follows it and is still owed to the workers (async
        # scheduling: it is filled once the step before it has landed).
        self._grammar_owed: SchedulerOutput | None = None
        self.batch_queue_size = batches_in_flight(config)
        # (step, its future, seconds spent scheduling it, seconds spent launching it)
        self.batch_queue: deque[tuple[SchedulerOutput, StepFuture, float, float]] | None = (
            deque() if self.batch_queue_size > 1 else None
        )
        self.step_times = StepTimes()
        if self.kv_events is not None:
            self.scheduler.kv_cache_manager.block_pool.kv_events = []
        parallel = config.parallel_config
        self.restart_budget = RestartBudget(parallel.max_worker_restarts, parallel.worker_restart_window_s)
        self._init_generation_control()
        self.lora_versions: dict[str, int] = {}
        logger.info(
            "Engine core ready in %.1f s: %d KV blocks of %d tokens (%d tokens)",
            time.perf_counter() - start,
            num_kv_blocks,
            config.cache_config.block_size,
            num_kv_blocks * config.cache_config.block_size,
        )

    def _check_capacity(self, num_kv_blocks: int) -> None:
        """One sequence of max_model_len tokens must fit, or it could never finish."""
        capacity = num_kv_blocks * self.config.cache_config.block_size
        max_model_len = self.config.model_config.max_model_len
        if capacity < max_model_len:
            self.executor.shutdown()
            raise ValueError(
                f"the KV cache holds {capacity} tokens, fewer than max_model_len={max_model_len}: "
                "lower max_model_len or give the KV cache more memory"
            )

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(
            Request(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params,
                eos_token_id=request.eos_token_id,
                max_tokens=request.max_tokens,
                arrival_time=request.arrival_time,
                lora_name=request.lora_name,
            )
        )

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        """Run one batch: schedule it, execute it on the workers, apply what they sampled; then
        publish the KV-cache events the step caused."""
        outputs = self._step()
        self.publish_kv_events()
        return outputs

    def publish_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.publish(self.scheduler.kv_cache_manager.block_pool.take_kv_events())

    def _step(self) -> EngineCoreOutputs:
        if self.batch_queue is not None:
            return self.step_with_batch_queue()
        start = time.perf_counter()
        scheduler_output = self._schedule()
        if scheduler_output.total_num_scheduled_tokens == 0:
            return self._idle_outputs()
        execute_start = time.perf_counter()
        try:  # free unless raised (zero-cost exceptions): nothing added to a step
            if scheduler_output.grammar_follows:
                model_output = self._execute_then_send_grammar(scheduler_output)
            else:
                model_output = self.executor.execute_model(scheduler_output)
        except WorkerDiedError as exc:
            return self.recover_from_worker_death(exc)
        execute_s = time.perf_counter() - execute_start
        outputs = attach_routed_experts(self._apply_output(scheduler_output, model_output), model_output)
        self.step_times.record(time.perf_counter() - start, execute_s)
        return outputs

    def step_with_batch_queue(self) -> EngineCoreOutputs:
        """Several batches at once: one per stage with pipeline parallelism, or with async
        scheduling the batch on the device and the next one. While the queue has room and
        something can be scheduled, schedule and launch another batch; otherwise wait for the
        oldest batch and apply what it sampled."""
        assert self.batch_queue is not None
        start = time.perf_counter()
        if len(self.batch_queue) < self.batch_queue_size and self.scheduler.has_schedulable_requests():
            scheduler_output = self._schedule()
            if scheduler_output.total_num_scheduled_tokens > 0:
                launch_start = time.perf_counter()
                future = self.executor.execute_model(scheduler_output, non_block=True)
                launch_s = time.perf_counter() - launch_start
                self.batch_queue.append((scheduler_output, future, launch_start - start, launch_s))
                if scheduler_output.grammar_follows:
                    self._owe_grammar(scheduler_output)
                return self._idle_outputs(wait=False)
        if not self.batch_queue:
            return self._idle_outputs()
        scheduler_output, future, schedule_s, launch_s = self.batch_queue.popleft()
        wait_start = time.perf_counter()
        try:
            model_output = future.result()
        except WorkerDiedError as exc:
            return self.recover_from_worker_death(exc)
        wait_s = time.perf_counter() - wait_start
        outputs = attach_routed_experts(self._apply_output(scheduler_output, model_output), model_output)
        self._send_owed_grammar()
        # The engine's own time for this step is scheduling it and applying its output; the
        # launch and the wait are the workers'.
        own_s = schedule_s + (time.perf_counter() - start - wait_s)
        self.step_times.record(own_s + launch_s + wait_s, launch_s + wait_s)
        return outputs

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's next step, with the host tier's block copies it must make first.
        Transferred KV loads in the background: the loads that ended make their requests
        schedulable first, and the loads of the requests this step parked start after it."""
        if self.kv_transfer is not None:
            self.kv_transfer.poll_loads()
        scheduler_output = self.scheduler.schedule()
        copies = self.host_tier.take_block_copies() if self.host_tier is not None else None
        if self.kv_transfer is not None:
            copies = self.kv_transfer.flush_block_copies(copies)
            self.kv_transfer.start_loads()
        if copies is not None:
            scheduler_output = msgspec.structs.replace(scheduler_output, kv_block_copies=copies)
        return scheduler_output

    def _apply_output(self, scheduler_output: SchedulerOutput, model_output: Any) -> EngineCoreOutputs:
        """Apply a step's output; prefills to hand to a decode engine are saved before their
        freed blocks can be reused."""
        if self.kv_transfer is None:
            return self.scheduler.update_from_output(scheduler_output, model_output)
        to_save = self.kv_transfer.blocks_to_save(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        if to_save:
            self.kv_transfer.save_finished(to_save, outputs)
        return outputs

    # ---- a worker's death --------------------------------------------------------------------

    def recover_from_worker_death(self, error: WorkerDiedError) -> EngineCoreOutputs:
        """Workers died: drop the batches in flight (their output will never come), requeue
        every running request for recompute, and have the executor re-create the dead workers
        (same bundles, groups re-formed, weights loaded, KV cache allocated again). The
        frontend's streams just wait; the tokens they already have are kept and recomputed, not
        sent again. Raises `EngineDeadError`, with the executor shut down, when the engine may
        not restart (see `_refuse_restart`)."""
        self._refuse_restart(error)
        logger.warning(
            "%s; restarting worker rank(s) %s (restart %d of at most %d within %g s)",
            error,
            list(error.ranks),
            self.restart_budget.num_recent,
            self.restart_budget.max_restarts,
            self.restart_budget.window_s,
        )
        start = time.perf_counter()
        if self.batch_queue is not None:
            self.batch_queue.clear()
        self._grammar_owed = None  # its step is gone
        num_requeued = self.scheduler.requeue_for_recompute()
        self.executor.restart_workers(list(error.ranks), self.num_kv_blocks)
        logger.warning(
            "workers restarted in %.1f s; %d running request(s) requeued for recompute",
            time.perf_counter() - start,
            num_requeued,
        )
        return self._idle_outputs(wait=False)

    def _refuse_restart(self, error: WorkerDiedError) -> None:
        """Shut down and raise `EngineDeadError` if the workers may not be re-created: the
        restart budget is spent, the weights were updated in place (a new worker would load
        the checkpoint's, and the ranks would disagree), or the engine is asleep (the survivors'
        weights and KV cache are not where a restart expects them)."""
        if self.scheduler.weights_updated_in_place:
            reason = "the weights were updated in place since they were loaded"
        elif self.sleeping_tags:
            reason = "the engine is asleep"
        elif not self.restart_budget.take():
            budget = self.restart_budget
            reason = (
                f"{budget.num_recent} worker restart(s) within {budget.window_s:g} s already "
                f"(max_worker_restarts={budget.max_restarts})"
            )
        else:
            return
        logger.error("%s; not restarting (%s): shutting the engine down", error, reason)
        self.executor.shutdown()
        raise EngineDeadError(f"{error}; not restarting: {reason}") from error

    def _idle_outputs(self, wait: bool = True) -> EngineCoreOutputs:
        """What a step that applied no output reports: the scheduler's statistics, and any
        request finished outside a step. With nothing to run but grammars being compiled or KV
        being loaded, it waits a little for them rather than spinning."""
        if wait and self.structured_output.compiling:
            self.structured_output.wait_for_any(self.structured_output.compiling, _GRAMMAR_POLL_S)
        elif wait and self.kv_transfer is not None and self.kv_transfer.num_loading:
            self.kv_transfer.poll_loads(wait_s=_KV_LOAD_POLL_S)
        return EngineCoreOutputs(
            outputs=self.scheduler.take_outputs_outside_steps(),
            scheduler_stats=self.scheduler.make_stats(),
            timestamp=time.time(),
        )

    # ---- structured output: a step whose bitmask follows its launch ----------------------------

    def _execute_then_send_grammar(self, scheduler_output: SchedulerOutput) -> Any:
        """One such step, synchronously: its bitmask is filled while the forward runs."""
        future = self.executor.execute_model(scheduler_output, non_block=True)
        self._send_grammar(scheduler_output)
        return future.result()

    def _owe_grammar(self, scheduler_output: SchedulerOutput) -> None:
        """A launched step's grammars see the tokens of the step before it once that one has
        landed (see `_send_owed_grammar`); with nothing before it, its bitmask can go now."""
        assert self.batch_queue is not None
        self._grammar_owed = scheduler_output
        if len(self.batch_queue) == 1:
            self._send_grammar(scheduler_output)

    def _send_owed_grammar(self) -> None:
        """A step has landed: if the next one ran ahead of it, its grammars now know this step's
        tokens, and its bitmask can go."""
        if self._grammar_owed is not None:
            self._send_grammar(self._grammar_owed)

    def _send_grammar(self, scheduler_output: SchedulerOutput) -> None:
        self._grammar_owed = None
        self.executor.sample_tokens(self.structured_output.grammar_bitmask(scheduler_output.structured_req_ids))

    # ---- utility calls (collective_rpc, cache control, health) ------------------------------

    def collective_rpc(
        self,
        method: str,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        return self.executor.collective_rpc(method, args, kwargs, timeout)

    def reset_prefix_cache(self) -> bool:
        reset = self.scheduler.reset_prefix_cache()
        self.publish_kv_events()  # AllBlocksCleared goes out now, not with the next step
        return reset

    def get_stats(self) -> dict[str, Any]:
        stats = self.scheduler.make_stats()
        return {
            "num_running_reqs": stats.num_running_reqs,
            "num_waiting_reqs": stats.num_waiting_reqs,
            "num_deferred_reqs": stats.num_deferred_reqs,
            "num_used_blocks": stats.num_used_blocks,
            "num_kv_blocks": self.num_kv_blocks,
            "kv_cache_usage": stats.kv_cache_usage,
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits,
            "num_preemptions": stats.num_preemptions,
            "num_steps": self.step_times.num_steps,
            "step_s": self.step_times.total_s,
            "execute_model_s": self.step_times.execute_s,
            "num_worker_restarts": self.restart_budget.num_restarts,
            **self.scheduler.spec_decoding_stats(),
            **(host_tier_stats(self.host_tier) if self.host_tier is not None else {}),
            **(self.kv_transfer.stats_dict() if self.kv_transfer is not None else {}),
        }

    def check_health(self) -> None:
        """Raise `EngineDeadError` if the engine cannot serve; workers found dead are
        re-created first (a death while idle is met here rather than by the next step)."""
        try:
            self.executor.check_health()
        except WorkerDiedError as exc:
            self.recover_from_worker_death(exc)

    def shutdown(self) -> None:
        if self.kv_events is not None:
            self.kv_events.shutdown()
        self.structured_output.shutdown()
        self.executor.shutdown()


def batches_in_flight(config: EngineConfig) -> int:
    """Pipeline parallelism keeps one batch in flight per stage; async scheduling keeps two, the
    one on the device and the next (see `EngineCore.step_with_batch_queue`)."""
    pp_size = config.parallel_config.pipeline_parallel_size
    if pp_size > 1:
        return pp_size
    return 2 if config.scheduler_config.async_scheduling else 1
