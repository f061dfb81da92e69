"""`PDConnector`: the engine core's side of prefill/decode disaggregation, as a `KVConnector`.

- On a prefill engine, a request whose params say `role="save"` runs as usual (the proxy asks
  for one token). When its output shows it finished, and before anything can reuse its blocks
  (the next step is not scheduled yet), the workers publish the blocks of its prompt less the
  last token under the request's `transfer_id` (`Worker.save_kv`). A failed save finishes the
  request as aborted with the stop reason `KV_TRANSFER_FAILED`, so the proxy retries it.
- On a decode engine, a request whose params say `role="load"` answers the scheduler's question
  (`num_loadable_tokens`) with the transferred tokens past its own prefix-cache hit; the scheduler
  allocates their blocks, and before the step runs the workers copy the transfer into them
  (`Worker.load_kv`, bounded by the params' timeout). A load that fails aborts the request (the
  same stop reason) and clears the prefix cache, which had registered the blocks the load was to
  fill. A request that is preempted later recomputes: its transfer is gone.

Requests without transfer params go to `inner` (the host-memory tier, when there is one).
Plain Python: the engine core imports this module.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shoal.errors import EngineDeadError
from shoal.kv_transfer.params import KV_TRANSFER_FAILED, KVTransferParams, transfer_params
from shoal.protocol import EngineCoreOutput, EngineCoreOutputs

if TYPE_CHECKING:
    from shoal.config import EngineConfig
    from shoal.engine_core.request import Request
    from shoal.engine_core.scheduler import Scheduler
    from shoal.executors.abstract import Executor
    from shoal.kv_transfer.connector import KVConnector
    from shoal.step import SchedulerOutput

logger = logging.getLogger(__name__)

# How much longer than a transfer's own timeout the engine waits for its workers' answer.
_RPC_MARGIN_S = 5.0


@dataclass
class TransferStats:
    """Cumulative counts of one engine's transfers (prefill side: saves; decode side: loads)."""

    num_saved: int = 0
    num_loaded: int = 0
    num_failed: int = 0
    tokens_loaded: int = 0
    transfer_s: float = 0.0


@dataclass
class _Load:
    request: Request
    params: KVTransferParams
    first_block: int
    block_ids: list[int]
    num_tokens: int


class PDConnector:
    def __init__(self, executor: Executor, scheduler: Scheduler, block_size: int, inner: KVConnector | None) -> None:
        self.executor = executor
        self.scheduler = scheduler
        self.block_size = block_size
        self.inner = inner
        self._loads: list[_Load] = []
        self.stats = TransferStats()

    # ---- the scheduler's questions (decode side) ---------------------------------------------

    def num_loadable_tokens(self, request: Request, num_computed_tokens: int) -> int:
        params = transfer_params(request.sampling_params.extra_args)
        if params is None or params.role != "load":
            return self.inner.num_loadable_tokens(request, num_computed_tokens) if self.inner else 0
        if request.num_preemptions or request.sampling_params.prompt_logprobs is not None:
            return 0  # a preempted request recomputes: its transfer was loaded (or failed) already
        return max(0, min(params.num_tokens, request.num_prompt_tokens - 1) - num_computed_tokens)

    def load_into(self, request: Request, block_ids: list[int], num_computed_tokens: int, num_tokens: int) -> None:
        params = transfer_params(request.sampling_params.extra_args)
        if params is None or params.role != "load":
            assert self.inner is not None
            self.inner.load_into(request, block_ids, num_computed_tokens, num_tokens)
            return
        first = num_computed_tokens // self.block_size
        last = -(-(num_computed_tokens + num_tokens) // self.block_size)
        self._loads.append(_Load(request, params, first, block_ids[first:last], num_tokens))

    def run_loads(self) -> None:
        """Copy the transfers of the step just scheduled into their blocks, before it runs."""
        loads, self._loads = self._loads, []
        for load in loads:
            timeout_s = load.params.timeout_s
            args = (load.params.transfer_id, load.first_block, load.block_ids, timeout_s)
            try:
                seconds = self.executor.collective_rpc("load_kv", args, timeout=timeout_s + _RPC_MARGIN_S)
            except EngineDeadError:
                raise
            except Exception as exc:  # any worker's failure is this request's, not the engine's
                self._fail_load(load, exc)
                continue
            self.stats.num_loaded += 1
            self.stats.tokens_loaded += load.num_tokens
            self.stats.transfer_s += max(seconds)

    def _fail_load(self, load: _Load, exc: Exception) -> None:
        request = load.request
        logger.warning("request %s: loading transfer %s failed: %s", request.request_id, load.params.transfer_id, exc)
        self.stats.num_failed += 1
        # The blocks it was to fill are registered in the prefix cache already, with no KV in them.
        self.scheduler.reset_prefix_cache()
        if self.scheduler.requests.get(request.request_id) is request:
            self.scheduler.abort_requests([request.request_id])
            # Reported as the scheduler reports requests finished outside a step.
            self.scheduler._outputs_outside_steps.append(
                EngineCoreOutput(
                    request.request_id, [], finish_reason="abort", stop_reason=f"{KV_TRANSFER_FAILED}: {exc}"
                )
            )

    # ---- the prefill side's saves --------------------------------------------------------------

    def blocks_to_save(self, scheduler_output: SchedulerOutput) -> dict[str, tuple[KVTransferParams, list[int]]]:
        """Before a step's output is applied (which frees finished requests' blocks): the blocks
        of its requests to save whose prompt is computed, should they finish now."""
        to_save = {}
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.scheduler.requests.get(request_id)
            if request is None or request.num_computed_tokens < request.num_prompt_tokens:
                continue
            params = transfer_params(request.sampling_params.extra_args)
            if params is not None and params.role == "save":
                num_blocks = -(-(request.num_prompt_tokens - 1) // self.block_size)
                block_ids = self.scheduler.kv_cache_manager.get_block_ids(request_id)[:num_blocks]
                to_save[request_id] = (params, block_ids)
        return to_save

    def save_finished(self, to_save: dict[str, tuple[KVTransferParams, list[int]]], outputs: EngineCoreOutputs) -> None:
        """Publish the KV of those that finished (their blocks are free but untouched)."""
        for output in outputs.outputs:
            if output.request_id not in to_save or not output.finished or output.finish_reason == "abort":
                continue
            params, block_ids = to_save[output.request_id]
            if not block_ids:
                continue
            try:
                seconds = self.executor.collective_rpc(
                    "save_kv", (params.transfer_id, block_ids), timeout=params.timeout_s
                )
            except EngineDeadError:
                raise
            except Exception as exc:
                logger.warning("request %s: saving transfer %s failed: %s", output.request_id, params.transfer_id, exc)
                self.stats.num_failed += 1
                output.finish_reason, output.stop_reason = "abort", f"{KV_TRANSFER_FAILED}: {exc}"
                continue
            self.stats.num_saved += 1
            self.stats.transfer_s += max(seconds)

    def stats_dict(self) -> dict[str, Any]:
        stats = self.stats
        return {
            "kv_transfer_saved": stats.num_saved,
            "kv_transfer_loaded": stats.num_loaded,
            "kv_transfer_failed": stats.num_failed,
            "kv_transfer_tokens_loaded": stats.tokens_loaded,
            "kv_transfer_seconds": stats.transfer_s,
        }


def start_kv_transfer(
    config: EngineConfig, executor: Executor, scheduler: Scheduler, inner: KVConnector | None
) -> PDConnector | None:
    """With `kv_transfer_role`, the engine saves and loads transfers: the connector becomes the
    scheduler's (in front of the host tier, if any)."""
    if config.cache_config.kv_transfer_role is None:
        return None
    connector = PDConnector(executor, scheduler, config.cache_config.block_size, inner)
    scheduler.kv_connector = connector
    return connector
