"""`PDConnector`: the engine core's side of prefill/decode disaggregation, as a `KVConnector`.

- On a prefill engine, a request whose params say `role="save"` runs as usual (the proxy asks
  for one token). When its output shows it finished, and before anything can reuse its blocks
  (the next step is not scheduled yet), the workers publish the blocks of its prompt less the
  last token under the request's `transfer_id` (`Worker.save_kv`). A failed save finishes the
  request as aborted with the stop reason `KV_TRANSFER_FAILED`, so the proxy retries it.
- On a decode engine, a request whose params say `role="load"` answers the scheduler's question
  (`num_loadable_tokens`) with the transferred tokens past its own prefix-cache hit, and loads
  them in the background: the scheduler parks the request with its blocks allocated
  (engine_core/remote_kv.py) while the other requests step on. Once the step that parked it is
  built, the workers start copying the transfer into its blocks, each on a thread of its own
  (`Worker.start_kv_load`, kv_transfer/background_loads.py); before each step the engine asks
  them which loads ended (`poll_loads`, an RPC made only while loads are in flight) and tells
  the scheduler. A load that failed on any worker, or that no worker finished by the params'
  timeout (plus a margin), is cancelled everywhere and aborts its request (the same stop
  reason); its blocks were never in the prefix cache. A request that is preempted later
  recomputes: its transfer is gone.

Requests without transfer params go to `inner` (the host-memory tier, when there is one).
Plain Python: the engine core imports this module.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shoal.errors import EngineDeadError
from shoal.kv_transfer.params import KV_TRANSFER_FAILED, KVTransferParams, transfer_params

if TYPE_CHECKING:
    from shoal.config import EngineConfig
    from shoal.engine_core.request import Request
    from shoal.engine_core.scheduler import Scheduler
    from shoal.executors.abstract import Executor
    from shoal.kv_transfer.connector import KVConnector
    from shoal.protocol import EngineCoreOutputs
    from shoal.step import KVBlockCopies, SchedulerOutput

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
    load_id: int
    request: Request
    params: KVTransferParams
    first_block: int
    block_ids: list[int]
    num_tokens: int
    deadline: float = 0.0  # (monotonic) past it, the engine gives the load up itself
    num_ranks_done: int = 0
    seconds: float = 0.0  # the slowest worker's


class PDConnector:
    def __init__(self, executor: Executor, scheduler: Scheduler, block_size: int, inner: KVConnector | None) -> None:
        self.executor = executor
        self.scheduler = scheduler
        self.block_size = block_size
        self.inner = inner
        self._load_ids = itertools.count()
        self._to_start: list[_Load] = []  # parked by the step being built
        self._loading: dict[int, _Load] = {}  # started, by load id
        self.stats = TransferStats()

    @property
    def num_loading(self) -> int:
        return len(self._to_start) + len(self._loading)

    # ---- the scheduler's questions (decode side) ---------------------------------------------

    def num_loadable_tokens(self, request: Request, num_computed_tokens: int) -> int:
        params = transfer_params(request.sampling_params.extra_args)
        if params is None or params.role != "load":
            return self.inner.num_loadable_tokens(request, num_computed_tokens) if self.inner else 0
        if request.num_preemptions or request.sampling_params.prompt_logprobs is not None:
            return 0  # a preempted request recomputes: its transfer was loaded (or given up) already
        return max(0, min(params.num_tokens, request.num_prompt_tokens - 1) - num_computed_tokens)

    def loads_in_background(self, request: Request) -> bool:
        params = transfer_params(request.sampling_params.extra_args)
        return params is not None and params.role == "load"

    def load_into(self, request: Request, block_ids: list[int], num_computed_tokens: int, num_tokens: int) -> None:
        params = transfer_params(request.sampling_params.extra_args)
        if params is None or params.role != "load":
            assert self.inner is not None
            self.inner.load_into(request, block_ids, num_computed_tokens, num_tokens)
            return
        first = num_computed_tokens // self.block_size
        last = -(-(num_computed_tokens + num_tokens) // self.block_size)
        self._to_start.append(_Load(next(self._load_ids), request, params, first, block_ids[first:last], num_tokens))

    def cancel_load(self, request: Request, workers_alive: bool = True) -> None:
        """Forget the request's load; if the workers started it, they cancel it (and write
        nothing more into its blocks once this returns)."""
        self._to_start = [load for load in self._to_start if load.request is not request]
        started = [load_id for load_id, load in self._loading.items() if load.request is request]
        for load_id in started:
            del self._loading[load_id]
        if started and workers_alive:
            self._cancel_on_workers(started)

    # ---- the loads, around each step -------------------------------------------------------------

    def start_loads(self) -> None:
        """The workers start the loads the step just built parked (each in the background)."""
        loads, self._to_start = self._to_start, []
        for load in loads:
            timeout_s = load.params.timeout_s
            args = (load.load_id, load.params.transfer_id, load.first_block, load.block_ids, timeout_s)
            load.deadline = time.monotonic() + timeout_s + _RPC_MARGIN_S
            self._loading[load.load_id] = load
            try:
                self.executor.collective_rpc("start_kv_load", args, timeout=_RPC_MARGIN_S)
            except EngineDeadError:
                raise
            except Exception as exc:  # any worker's failure is this request's, not the engine's
                self._fail(load, f"{type(exc).__name__}: {exc}")

    def poll_loads(self, wait_s: float = 0.0) -> None:
        """Ask the workers which loads ended (each waits at most `wait_s` for one to), and
        tell the scheduler of those that ended on every worker, or failed on one; give up
        loads past their deadline."""
        if not self._loading:
            return
        per_rank = self._ask_workers("ended_kv_loads", (wait_s,), wait_s + _RPC_MARGIN_S) or []
        for ended in per_rank:
            for load_id, seconds, error in ended:
                load = self._loading.get(load_id)
                if load is None:
                    continue  # failed on another rank, or cancelled, already
                if error is not None:
                    self._fail(load, error)
                    continue
                load.num_ranks_done += 1
                load.seconds = max(load.seconds, seconds)
                if load.num_ranks_done == len(per_rank):
                    self._succeed(load)
        now = time.monotonic()
        for load in [load for load in self._loading.values() if now >= load.deadline]:
            self._fail(load, f"no worker finished it within {load.params.timeout_s + _RPC_MARGIN_S:g} s")

    def _succeed(self, load: _Load) -> None:
        del self._loading[load.load_id]
        self.stats.num_loaded += 1
        self.stats.tokens_loaded += load.num_tokens
        self.stats.transfer_s += load.seconds
        self.scheduler.end_kv_load(load.request, None)

    def _fail(self, load: _Load, error: str) -> None:
        """Cancel the load on every worker (some may still be copying), then end its request."""
        logger.warning(
            "request %s: loading transfer %s failed: %s", load.request.request_id, load.params.transfer_id, error
        )
        del self._loading[load.load_id]
        self._cancel_on_workers([load.load_id])
        self.stats.num_failed += 1
        self.scheduler.end_kv_load(load.request, f"{KV_TRANSFER_FAILED}: {error}")

    def _cancel_on_workers(self, load_ids: list[int]) -> None:
        self._ask_workers("cancel_kv_loads", (load_ids,), _RPC_MARGIN_S)

    def _ask_workers(self, method: str, args: tuple, timeout_s: float) -> list[Any] | None:
        """A call to every worker; None if one failed it (the loads' deadlines still bound every
        request: a worker's failure is not the engine's)."""
        try:
            return self.executor.collective_rpc(method, args, timeout=timeout_s)
        except EngineDeadError:
            raise
        except Exception as exc:
            logger.warning("KV loads: %s failed on a worker: %s", method, exc)
            return None

    def flush_block_copies(self, copies: KVBlockCopies | None) -> KVBlockCopies | None:
        """Before loads start: the host tier's copies of the step (offloads of the blocks the
        loads' allocations evicted) are made now, not with the step, so that no load writes a
        block before its old KV is offloaded. Returns what the step still carries."""
        if copies is None or not self._to_start:
            return copies
        self.executor.collective_rpc("copy_kv_blocks", (copies,))
        return None

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
            "kv_transfer_loading": self.num_loading,
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
