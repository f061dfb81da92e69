"""`RayExecutor`: one worker actor per GPU (or CPU bundle) of a Ray placement group, for tensor
and pipeline parallelism on one node or many.

Start-up: join the Ray cluster (or start a local one); reserve `tp * pp` bundles, driver-node
first; start one `RayWorker` per bundle, rank `pp_rank * tp + tp_rank`; ask rank 0 for its
node's IP and a free port, from which every worker joins the torch.distributed world (on GPU
each group also gets an NCCL communicator, its unique id made by the group's rank 0 and passed
through Ray); load the model.

A step is encoded once (msgspec), put in the object store once, and every worker gets the same
reference; all of them run it, and only the last stage's tensor rank 0 returns tokens. Waiting
watches every worker at once, so a worker that dies surfaces as `EngineDeadError` within a
moment even while the others sit blocked in a collective with it (shutdown kills them).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import msgspec
import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from shoal.distributed.communicator import NcclUniqueId
from shoal.distributed.parallel_state import pp_group_ranks, tp_group_ranks
from shoal.engine_core.batch import ModelRunnerOutput, SchedulerOutput
from shoal.errors import EngineDeadError
from shoal.executors import ray_utils
from shoal.executors.abstract import Executor

logger = logging.getLogger(__name__)

# How long a health check waits for every worker to answer a ping.
HEALTH_CHECK_TIMEOUT_S = 5.0


class RayExecutor(Executor):
    def _init_workers(self) -> None:
        parallel = self.config.parallel_config
        self.device = self.config.device_config.device
        self.tp_size, self.pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        # The rank whose output the engine uses: the last stage's tensor-parallel rank 0.
        self.sampling_rank = (self.pp_size - 1) * self.tp_size
        self.workers: list[Any] = []  # actor handles in rank order
        self._dead: str | None = None
        num_cpus = max(os.cpu_count() or 1, parallel.world_size) if self.device == "cpu" else None
        ray_utils.connect_to_ray(parallel.ray_address, num_cpus)
        self.placement_group, bundle_indices, self._owns_placement_group = ray_utils.reserve_placement_group(
            parallel.world_size, self.device, parallel.placement_group_timeout_s
        )
        try:
            self.workers = self._start_workers(bundle_indices)
            # The first call waits for every actor to be scheduled and constructed.
            self.collective_rpc("init_device", timeout=parallel.placement_group_timeout_s)
            self.worker_node_ids: list[str] = self._wait([w.node_id.remote() for w in self.workers], None, "start-up")
            self.collective_rpc("init_distributed", (self._init_method(), self._nccl_unique_ids()))
            self.collective_rpc("load_model")
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "Ray executor: %d workers (tensor parallel %d x pipeline parallel %d) on %d node(s)",
            parallel.world_size,
            self.tp_size,
            self.pp_size,
            len(set(self.worker_node_ids)),
        )

    @property
    def stage_workers(self) -> list[list[Any]]:
        """The workers as `stage_workers[pp_rank][tp_rank]`."""
        return [self.workers[p * self.tp_size : (p + 1) * self.tp_size] for p in range(self.pp_size)]

    # ---- start-up ------------------------------------------------------------------------------

    def _start_workers(self, bundle_indices: list[int]) -> list[Any]:
        """One actor per rank, pinned to its bundle, with the forwarded environment."""
        resources = {"num_gpus": 1, "num_cpus": 0} if self.device == "cuda" else {"num_cpus": 1}
        runtime_env = {"env_vars": ray_utils.worker_env_vars(self.device)}
        return [
            ray_utils.RayWorker.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=bundle_index
                ),
                runtime_env=runtime_env,
                **resources,
            ).remote(self.config, rank)
            for rank, bundle_index in enumerate(bundle_indices)
        ]

    def _init_method(self) -> str:
        """tcp://<rank 0's node IP>:<a port free there>, where torch.distributed meets."""
        ip, port = self._wait([self.workers[0].node_ip_and_free_port.remote()], None, "start-up")[0]
        return f"tcp://{ip}:{port}"

    def _nccl_unique_ids(self) -> dict[tuple[int, ...], NcclUniqueId] | None:
        """On GPU, a unique id for every group of more than one rank, made by its rank 0."""
        if self.device != "cuda":
            return None
        groups = tp_group_ranks(self.tp_size, self.pp_size) + pp_group_ranks(self.tp_size, self.pp_size)
        groups = [g for g in groups if len(g) > 1]
        ids = self._wait([self.workers[g[0]].make_nccl_unique_id.remote() for g in groups], None, "start-up")
        return {tuple(g): unique_id for g, unique_id in zip(groups, ids)}

    # ---- steps and calls ------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False) -> Any:
        self._check_alive()
        step = ray.put(msgspec.msgpack.encode(scheduler_output))  # serialized once, stored once
        future = RayStepFuture(self, [w.execute_model.remote(step) for w in self.workers])
        return future if non_block else future.result()

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        self._check_alive()
        refs = [w.execute_method.remote(method, args, kwargs or {}) for w in self.workers]
        name = method if isinstance(method, str) else getattr(method, "__name__", "a function")
        return self._wait(refs, timeout, f"collective_rpc({name})")

    def _wait(self, refs: list[Any], timeout: float | None, what: str) -> list[Any]:
        """Each worker's result, in rank order (`refs` holds one call per rank).

        Watches every call at once, so that a dead worker raises `EngineDeadError` as soon as
        Ray reports it rather than after the calls before it, which may never return (their
        workers are blocked in a collective with the dead one). TimeoutError past `timeout`.
        """
        results: dict[Any, Any] = {}
        pending = list(refs)
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            if not ready:
                ranks = [refs.index(ref) for ref in pending]
                raise TimeoutError(f"{what}: worker ranks {ranks} did not answer within {timeout:g} s")
            try:
                results[ready[0]] = ray.get(ready[0])
            except RayActorError as exc:
                who = f"worker rank {refs.index(ready[0])}" if len(refs) == len(self.workers) else "a worker"
                raise self._mark_dead(f"{who} died during {what}: {_first_line(exc)}") from exc
        return [results[ref] for ref in refs]

    def _mark_dead(self, reason: str) -> EngineDeadError:
        """Remember why the engine cannot run any more; every later call fails with it."""
        self._dead = reason
        return EngineDeadError(reason)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    # ---- health and shutdown ----------------------------------------------------------------------

    def check_health(self) -> None:
        """Ping every worker (answered on a thread of its own, even during a step)."""
        try:
            self._wait([w.ping.remote() for w in self.workers], HEALTH_CHECK_TIMEOUT_S, "a health check")
        except TimeoutError as exc:
            raise EngineDeadError(str(exc)) from exc
        self._check_alive()

    def shutdown(self) -> None:
        """Kill the workers and remove the placement group if this executor created it."""
        if not ray.is_initialized():
            return
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []
        if self._owns_placement_group and self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
        self.placement_group = None


class RayStepFuture:
    """A step running on every worker; `result()` gives the sampling rank's output."""

    def __init__(self, executor: RayExecutor, refs: list[Any]) -> None:
        self.executor = executor
        self.refs = refs

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        try:
            outputs = self.executor._wait(self.refs, timeout, "a step")
        except RayTaskError as exc:
            # A worker raised mid-step: its peers may be stuck in a collective; nothing can run.
            raise self.executor._mark_dead(f"a worker failed during a step: {_first_line(exc)}") from exc
        return msgspec.msgpack.decode(outputs[self.executor.sampling_rank], type=ModelRunnerOutput)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
