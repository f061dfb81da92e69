"""`RayExecutor`: one worker actor per GPU (or CPU bundle) of a Ray placement group, for tensor
and pipeline parallelism on one node or many.

Start-up: join the Ray cluster (or start a local one); reserve `tp * pp` bundles, driver-node
first; start one `RayWorker` per bundle, rank `pp_rank * tp + tp_rank`; ask rank 0 for its
node's IP and a free port, from which every worker joins the torch.distributed world (on GPU
each group also gets an NCCL communicator, its unique id made by the group's rank 0 and passed
through Ray); load the model.

A step is encoded once (msgspec), put in the object store once, and every worker gets the same
reference; all of them run it, and only the last stage's tensor rank 0 returns tokens. Waiting
watches every worker at once, so a worker that dies during a step surfaces as `WorkerDiedError`
within a moment even while the others sit blocked in a collective with it. The engine core then
calls `restart_workers`: the dead actor is re-created in its bundle, every rank joins a new
torch.distributed world (new groups, new NCCL communicators), the new worker loads the model and
every worker allocates its KV cache again. A death anywhere else (start-up, `collective_rpc`,
the restart itself) is `EngineDeadError`: the engine is dead.

Workers are named actors (`shoal-worker-<engine id>-<rank>-<incarnation>` in the namespace
`shoal`), so that `ray list actors` tells them apart.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import msgspec
import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from shoal.distributed.communicator import NcclUniqueId
from shoal.distributed.parallel_state import pp_group_ranks, tp_group_ranks
from shoal.errors import EngineDeadError, WorkerDiedError
from shoal.executors import ray_checks, ray_utils
from shoal.executors.abstract import Executor
from shoal.step import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

# How long a health check waits for every worker to answer a ping.
HEALTH_CHECK_TIMEOUT_S = 5.0
# After a worker died, how long a survivor may take to finish the calls queued on it before it
# rejoins. On gloo its step fails within milliseconds once the dead peer's sockets close; NCCL
# cannot tell, and a survivor blocked in a collective with the dead peer is re-created too.
DRAIN_TIMEOUT_S = 10.0
# The Ray namespace of the worker actors' names.
WORKER_NAMESPACE = "shoal"
# How long the workers may take to form their torch.distributed world (and NCCL communicators)
# before the engine gives up and says which network settings to check.
DISTRIBUTED_SETUP_TIMEOUT_S = 25.0


class RayExecutor(Executor):
    def _init_workers(self) -> None:
        parallel = self.config.parallel_config
        self.device = self.config.device_config.device
        self.tp_size, self.pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        # The rank whose output the engine uses: the last stage's tensor-parallel rank 0.
        self.sampling_rank = (self.pp_size - 1) * self.tp_size
        # Actor handles in rank order, and what a shutdown releases (see RayResources).
        self._resources = RayResources()
        self.workers: list[Any] = self._resources.workers
        self._finalizer = weakref.finalize(self, self._resources.release)
        self._dead: str | None = None
        self.engine_id = uuid.uuid4().hex[:12]
        self._incarnations = [0] * parallel.world_size  # how many times each rank was started
        # The calls of a step that failed: read once the survivors are drained, so that Ray does
        # not report their errors as unhandled.
        self._failed_step_refs: list[Any] = []
        num_cpus = max(os.cpu_count() or 1, parallel.world_size) if self.device == "cpu" else None
        ray_utils.connect_to_ray(parallel.ray_address, num_cpus)
        self.placement_group, bundle_indices, self._owns_placement_group = ray_utils.reserve_placement_group(
            parallel.world_size, self.device, parallel.placement_group_timeout_s, parallel
        )
        if self._owns_placement_group:
            self._resources.placement_group = self.placement_group
        self.bundle_indices = bundle_indices  # by rank
        try:
            self.workers.extend(self._start_worker(rank) for rank in range(parallel.world_size))
            # The first call waits for every actor to be scheduled and constructed.
            self._check_worker_environments(parallel.placement_group_timeout_s)
            self.collective_rpc("init_device")
            self.worker_node_ids: list[str] = self._wait([w.node_id.remote() for w in self.workers], None, "start-up")
            self._init_distributed()
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

    def _start_worker(self, rank: int) -> Any:
        """The actor of `rank`, pinned to its bundle, named, with the forwarded environment."""
        parallel = self.config.parallel_config
        if self.device == "cuda":  # a share of a GPU when a colocated trainer has the rest
            resources = {"num_gpus": parallel.num_gpus_per_worker, "num_cpus": 0.0}
        else:
            resources = {"num_cpus": parallel.num_cpus_per_worker}
        runtime_env = {"env_vars": ray_utils.worker_env_vars(self.device)}
        return ray_utils.RayWorker.options(
            name=f"shoal-worker-{self.engine_id}-{rank}-{self._incarnations[rank]}",
            namespace=WORKER_NAMESPACE,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=self.bundle_indices[rank]
            ),
            runtime_env=runtime_env,
            **resources,
        ).remote(self.config, rank, self.bundle_indices[rank])

    def _check_worker_environments(self, timeout_s: float) -> None:
        """Every worker's node runs the driver's Python, torch and shoal, has the model folder
        and (on GPU) a GPU the actor sees; otherwise one `RuntimeError` naming each node's problems."""
        versions, model = ray_checks.local_versions(), self.config.model_config.model
        refs = [w.environment_problems.remote(versions, model) for w in self.workers]
        answers = self._wait(refs, timeout_s, "start-up (the workers' environment check)")
        bad = [(rank, ip, problems) for rank, (ip, problems) in enumerate(answers) if problems]
        if bad:
            raise RuntimeError(ray_checks.node_problems_message(bad))

    def _init_distributed(self) -> None:
        """Every worker joins the torch.distributed world; a failure, or a rendezvous that does
        not finish within DISTRIBUTED_SETUP_TIMEOUT_S, is a `RuntimeError` naming the network
        variables to check."""
        init_method = self._init_method()
        try:
            self.collective_rpc(
                "init_distributed", (init_method, self._nccl_unique_ids()), timeout=DISTRIBUTED_SETUP_TIMEOUT_S
            )
        except TimeoutError as exc:
            raise RuntimeError(
                ray_checks.distributed_setup_message(init_method, DISTRIBUTED_SETUP_TIMEOUT_S, None)
            ) from exc
        except RayTaskError as exc:
            raise RuntimeError(ray_checks.distributed_setup_message(init_method, None, _cause(exc))) from exc

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

    def _wait(self, refs: list[Any], timeout: float | None, what: str, ranks: list[int] | None = None) -> list[Any]:
        """Each call's result, in order (`refs` holds one call per rank, or per rank of
        `ranks`); a dead worker is `EngineDeadError` (see `_gather`)."""
        try:
            return self._gather(refs, timeout, what, ranks)
        except _WorkerLost as lost:
            raise self._mark_dead(f"worker rank {lost.rank} died during {what}: {_first_line(lost.error)}") from (
                lost.error
            )

    def _gather(self, refs: list[Any], timeout: float | None, what: str, ranks: list[int] | None = None) -> list[Any]:
        """Each call's result, in order. Watches every call at once, so that a dead worker is
        reported (`_WorkerLost`) as soon as Ray knows rather than after the calls before it,
        which may never return (their workers are blocked in a collective with the dead one).
        A worker's own exception comes as Ray raises it; TimeoutError past `timeout`."""
        ranks = list(range(len(refs))) if ranks is None else ranks
        results: dict[Any, Any] = {}
        pending = list(refs)
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            if not ready:
                late = [ranks[refs.index(ref)] for ref in pending]
                raise TimeoutError(f"{what}: worker ranks {late} did not answer within {timeout:g} s")
            try:
                results[ready[0]] = ray.get(ready[0])
            except RayActorError as exc:
                raise _WorkerLost(ranks[refs.index(ready[0])], exc) from exc
        return [results[ref] for ref in refs]

    def _step_failed(self, error: BaseException) -> EngineDeadError:
        """A step failed: a worker died (and its peers' steps failed with it, in a collective),
        or a worker raised. `WorkerDiedError` naming the dead workers if there are any, which
        the engine core may re-create; otherwise the engine is dead."""
        dead = self._unresponsive_ranks()
        if dead:
            return WorkerDiedError(dead, f"{_ranks_text(dead)} died during a step: {_first_line(error)}")
        return self._mark_dead(f"a worker failed during a step: {_first_line(error)}")

    def _unresponsive_ranks(self, timeout: float = HEALTH_CHECK_TIMEOUT_S) -> list[int]:
        """The ranks whose actor is dead or does not answer a ping within `timeout` (pings are
        answered on a thread of their own, even in the middle of a step)."""
        return _unanswered([w.ping.remote() for w in self.workers], list(range(len(self.workers))), timeout)

    def _mark_dead(self, reason: str) -> EngineDeadError:
        """Remember why the engine cannot run any more; every later call fails with it."""
        self._dead = reason
        return EngineDeadError(reason)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    # ---- health and shutdown ----------------------------------------------------------------------

    def check_health(self) -> None:
        """Ping every worker (answered on a thread of its own, even during a step); a worker
        that is dead or does not answer within HEALTH_CHECK_TIMEOUT_S is `WorkerDiedError`."""
        self._check_alive()
        dead = self._unresponsive_ranks()
        if dead:
            raise WorkerDiedError(dead, f"{_ranks_text(dead)} found dead by a health check")

    # ---- restarts -------------------------------------------------------------------------------

    def restart_workers(self, ranks: list[int], num_kv_blocks: int) -> None:
        """Re-create the workers of `ranks` in their bundles, and any survivor that cannot
        finish what it was doing (see DRAIN_TIMEOUT_S); the other survivors keep their weights
        and leave their groups. Then every rank joins a new world, the new workers load the
        model, and every worker allocates its KV cache of `num_kv_blocks` blocks again. Any
        failure on the way (a worker dying or raising, a bundle that cannot be placed again
        within placement_group_timeout_s) is `EngineDeadError`."""
        self._check_alive()
        try:
            self._restart(ranks, num_kv_blocks)
        except (TimeoutError, RayTaskError, RuntimeError) as exc:
            raise self._mark_dead(f"restarting worker ranks {ranks} failed: {_first_line(exc)}") from exc

    def _restart(self, ranks: list[int], num_kv_blocks: int) -> None:
        replaced = sorted(set(ranks) | set(self._stuck_ranks([r for r in range(len(self.workers)) if r not in ranks])))
        survivors = [rank for rank in range(len(self.workers)) if rank not in replaced]
        for rank in replaced:
            ray.kill(self.workers[rank])  # dead already, or stuck in a collective with the dead
        self._read_failed_step()
        self._call(survivors, "leave_distributed")
        for rank in replaced:
            self._incarnations[rank] += 1
            self.workers[rank] = self._start_worker(rank)
        # The first call waits for the new actors to be scheduled (their bundles freed) and built.
        self._call(replaced, "init_device", timeout=self.config.parallel_config.placement_group_timeout_s)
        self.worker_node_ids = self._wait([w.node_id.remote() for w in self.workers], None, "a restart")
        self._init_distributed()
        self._call(replaced, "load_model")
        self.collective_rpc("initialize_kv_cache", (num_kv_blocks,))
        logger.info("re-created worker rank(s) %s; every rank rejoined", replaced)

    def _stuck_ranks(self, ranks: list[int]) -> list[int]:
        """Those of `ranks` that do not finish the calls queued on them within DRAIN_TIMEOUT_S
        (or died meanwhile): a call queued behind them answers when they are done."""
        refs = [self.workers[rank].execute_method.remote("check_health", (), {}) for rank in ranks]
        return _unanswered(refs, ranks, DRAIN_TIMEOUT_S)

    def _read_failed_step(self) -> None:
        """Read the failed step's results that are in (its errors are known and expected)."""
        refs, self._failed_step_refs = self._failed_step_refs, []
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
        for ref in ready:
            with contextlib.suppress(RayActorError, RayTaskError):
                ray.get(ref)

    def _call(self, ranks: list[int], method: str, timeout: float | None = None) -> list[Any]:
        """`method` on the workers of `ranks` only (a restart's steps)."""
        refs = [self.workers[rank].execute_method.remote(method, (), {}) for rank in ranks]
        return self._wait(refs, timeout, f"a restart ({method})", ranks)

    def shutdown(self) -> None:
        """Kill the workers and remove the placement group if this executor created it (a
        caller's group stays); idempotent. Garbage collection of the executor does the same."""
        if self._dead is None:
            self._dead = "the executor is shut down"
        if ray.is_initialized():
            self._read_failed_step()
        self._finalizer()
        self.placement_group = None


class RayResources:
    """What a `RayExecutor` holds in the Ray cluster: its worker actors and, when it made it,
    its placement group. A finalizer releases them, so an executor dropped without `shutdown()`
    (an in-process `LLM` garbage-collected) frees its bundles too."""

    def __init__(self) -> None:
        self.workers: list[Any] = []  # the executor's own list: restarts replace entries in place
        self.placement_group: Any = None  # only a group the executor created

    def release(self) -> None:
        if not ray.is_initialized():  # disconnected (at exit): Ray releases a gone job's actors
            return
        for worker in self.workers:
            ray.kill(worker)
        self.workers.clear()
        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None


class RayStepFuture:
    """A step running on every worker; `result()` gives the sampling rank's output."""

    def __init__(self, executor: RayExecutor, refs: list[Any]) -> None:
        self.executor = executor
        self.refs = refs

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        try:
            outputs = self.executor._gather(self.refs, timeout, "a step")
        except _WorkerLost as lost:
            self.executor._failed_step_refs = self.refs
            raise self.executor._step_failed(lost.error) from lost.error
        except RayTaskError as exc:
            # A worker raised: a peer died under it (the collective failed), or a bug.
            self.executor._failed_step_refs = self.refs
            raise self.executor._step_failed(exc) from exc
        return msgspec.msgpack.decode(outputs[self.executor.sampling_rank], type=ModelRunnerOutput)


class _WorkerLost(Exception):
    """The actor of `rank` died while a call waited on it (`RayExecutor._gather`)."""

    def __init__(self, rank: int, error: RayActorError) -> None:
        super().__init__(rank, error)
        self.rank = rank
        self.error = error


def _unanswered(refs: list[Any], ranks: list[int], timeout: float) -> list[int]:
    """Those of `ranks` (one call each, in `refs`) whose call did not answer within `timeout`
    or whose actor died."""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout) if refs else ([], [])
    answered = set(ready)
    return [rank for rank, ref in zip(ranks, refs) if ref not in answered or _actor_died(ref)]


def _actor_died(ref: Any) -> bool:
    """Whether the (finished) call `ref` failed because its actor died."""
    try:
        ray.get(ref)
    except RayActorError:
        return True
    return False


def _ranks_text(ranks: list[int]) -> str:
    return f"worker rank {ranks[0]}" if len(ranks) == 1 else f"worker ranks {', '.join(map(str, ranks))}"


def _cause(exc: RayTaskError) -> BaseException:
    """The worker's own exception inside a `RayTaskError` (its first line says what failed)."""
    return getattr(exc, "cause", None) or exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
