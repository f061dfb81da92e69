"""Ray plumbing for `RayExecutor`: joining (or starting) a cluster, reserving one placement-group
bundle per worker, ordering the bundles driver-node first, and the worker actor itself.

shoal imports Ray only in `shoal/executors/` and `cluster/`.
"""

from __future__ import annotations

import logging
import socket
import uuid
from typing import Any

import msgspec
import ray
from ray.util.placement_group import PlacementGroup, get_current_placement_group, placement_group_table

from shoal import envs
from shoal.config import EngineConfig
from shoal.distributed.communicator import NcclUniqueId, nccl_unique_id
from shoal.engine_core.batch import ModelRunnerOutput, SchedulerOutput
from shoal.executors import ray_checks

logger = logging.getLogger(__name__)

# The worker actors' control methods (health pings) run on a thread of their own, so that a
# ping is answered while a step is running.
HEALTH_CONCURRENCY_GROUP = "health"


# ---- the cluster -----------------------------------------------------------------------------------


def connect_to_ray(address: str | None, num_cpus: int | None) -> None:
    """Join a running Ray cluster: `address` when given, else RAY_ADDRESS, else one running on
    this node (the latest `ray start`). With none running, start a local one with `num_cpus`
    logical CPUs. Nothing happens when this process is already connected (a user's driver, or
    shoal running inside a Ray actor)."""
    if ray.is_initialized():
        return
    quiet: dict[str, Any] = dict(logging_level=logging.WARNING, log_to_driver=True)
    # RAY_ADDRESS is Ray's own variable: an address given there must be reached, not replaced.
    source = "ray_address" if address else "RAY_ADDRESS"
    address = address or envs.RAY_ADDRESS
    if address:
        ray_checks.check_gcs_reachable(address, source)  # Ray would retry a dead one for minutes
        ray.init(address=address, **quiet)
        logger.info("Joined the Ray cluster at %s", ray.get_runtime_context().gcs_address)
        return
    stale = ray_checks.stale_local_address()
    if stale is not None:
        logger.warning(
            "The Ray cluster last started on this node (%s) is gone (a node that died without `ray stop`); "
            "starting a local one. Run `ray stop` to forget it, or set RAY_ADDRESS to the cluster's head.",
            stale,
        )
    else:
        try:
            ray.init(address="auto", **quiet)
        except ConnectionError:  # no cluster on this node
            stale = "none"
    if stale is not None:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **quiet)
        logger.info("Started a local Ray cluster (%s CPUs)", num_cpus or "all")
        return
    logger.info("Joined the Ray cluster at %s", ray.get_runtime_context().gcs_address)


def worker_bundle(device: str) -> dict[str, float]:
    """The resources of one worker: a GPU, or on CPU one logical CPU."""
    return {"GPU": 1.0} if device == "cuda" else {"CPU": 1.0}


# ---- the placement group ----------------------------------------------------------------------------


def reserve_placement_group(
    num_workers: int, device: str, timeout_s: float, strategy: str = "PACK"
) -> tuple[PlacementGroup, list[int], bool]:
    """(placement group, the bundle index of each rank, whether shoal created the group).

    Inside a placement group already (shoal started from a user's actor or task), the workers
    go into that group's bundles that hold the worker resource; otherwise a new group of
    `num_workers` bundles is created (with Ray's `strategy`) and waited for. Ranks get bundles on the driver's node
    first, then node by node, so that a tensor-parallel group shares a node whenever it can.
    """
    bundle = worker_bundle(device)
    resource = next(iter(bundle))
    current = get_current_placement_group()
    if current is not None:
        usable = [i for i, spec in enumerate(current.bundle_specs) if spec.get(resource, 0) >= bundle[resource]]
        if len(usable) < num_workers:
            raise ValueError(
                f"the current placement group has {len(usable)} bundles with {bundle}, "
                f"{num_workers} workers need one each"
            )
        wait_for_placement_group(current, [bundle] * num_workers, timeout_s)
        return current, driver_node_first(current, usable)[:num_workers], False
    bundles = [dict(bundle) for _ in range(num_workers)]
    group = ray.util.placement_group(bundles, strategy=strategy, name=f"shoal-{uuid.uuid4().hex[:12]}")
    try:
        wait_for_placement_group(group, bundles, timeout_s)
    except BaseException:
        ray.util.remove_placement_group(group)
        raise
    return group, driver_node_first(group, list(range(num_workers))), True


def wait_for_placement_group(group: PlacementGroup, bundles: list[dict[str, float]], timeout_s: float) -> None:
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        raise RuntimeError(missing_resources_message(bundles, timeout_s))


def missing_resources_message(bundles: list[dict[str, float]], timeout_s: float) -> str:
    """Which resources the request needs, against what the cluster has and has free."""
    needed: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            needed[name] = needed.get(name, 0.0) + amount
    total, available = ray.cluster_resources(), ray.available_resources()
    lines = [
        f"{name}: {amount:g} needed, {total.get(name, 0.0):g} in the cluster, {available.get(name, 0.0):g} free"
        for name, amount in sorted(needed.items())
    ]
    return (
        f"Ray could not reserve {len(bundles)} worker bundles {bundles[0]} within {timeout_s:g} s "
        f"({'; '.join(lines)}). Add nodes (cluster/start_worker.sh), free resources other jobs hold "
        "(`ray status`), or lower tensor_parallel_size x pipeline_parallel_size."
    )


def driver_node_first(group: PlacementGroup, bundle_indices: list[int]) -> list[int]:
    """`bundle_indices` of a ready group, in rank order (see `order_bundles`)."""
    bundle_nodes = placement_group_table(group)["bundles_to_node_id"]
    return order_bundles(bundle_indices, bundle_nodes, ray.get_runtime_context().get_node_id())


def order_bundles(bundle_indices: list[int], bundle_nodes: dict[int, str], driver_node: str) -> list[int]:
    """The bundles on the driver's node first, then those of each other node together (so
    that consecutive ranks, a tensor-parallel group, share a node whenever they can)."""
    return sorted(bundle_indices, key=lambda i: (bundle_nodes[i] != driver_node, bundle_nodes[i], i))


def worker_env_vars(device: str) -> dict[str, str]:
    """The environment every worker gets (`envs.forwarded_environment()`); on CPU, one torch
    thread per worker unless SHOAL_CPU_THREADS says otherwise (a worker holds one CPU)."""
    env = envs.forwarded_environment()
    if device == "cpu":
        env.setdefault("SHOAL_CPU_THREADS", "1")
        env.setdefault("OMP_NUM_THREADS", env["SHOAL_CPU_THREADS"])
    return env


# ---- the worker actor ------------------------------------------------------------------------------


@ray.remote(concurrency_groups={HEALTH_CONCURRENCY_GROUP: 1})
class RayWorker:
    """One `shoal.workers.worker.Worker` in a Ray actor, plus what only the actor knows: its
    node, a free port for the process group, NCCL ids. Steps arrive as msgspec bytes (encoded
    once for all workers) and the sampled tokens go back the same way."""

    def __init__(self, config: EngineConfig, rank: int) -> None:
        from shoal.logger import configure_logging
        from shoal.workers.worker import Worker

        configure_logging()
        self.device = config.device_config.device
        # Without a GPU the worker is not built; `environment_problems` then says why.
        has_gpu = self.device != "cuda" or ray.get_runtime_context().get_accelerator_ids().get("GPU")
        local_rank = local_gpu_index() if self.device == "cuda" and has_gpu else 0
        self.worker = Worker(config, rank=rank, local_rank=local_rank)
        self._decoder = msgspec.msgpack.Decoder(SchedulerOutput)
        self._encoder = msgspec.msgpack.Encoder()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def environment_problems(self, driver_versions: ray_checks.Versions, model_path: str) -> tuple[str, list[str]]:
        """(this node's IP, what keeps the engine from running here: `ray_checks`)."""
        problems = ray_checks.environment_problems(driver_versions, model_path, self.device)
        return ray.util.get_node_ip_address(), problems

    def node_ip_and_free_port(self) -> tuple[str, int]:
        """This node's IP and a port free on it now (for the rank-0 rendezvous)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def make_nccl_unique_id(self) -> NcclUniqueId:
        """An NCCL unique id for a group this worker is rank 0 of (it hosts the bootstrap)."""
        return nccl_unique_id()

    def execute_method(self, method: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        return self.worker.call(method, args, kwargs)

    def execute_model(self, encoded_scheduler_output: bytes) -> bytes | None:
        output: ModelRunnerOutput | None = self.worker.execute_model(self._decoder.decode(encoded_scheduler_output))
        return None if output is None else self._encoder.encode(output)

    @ray.method(concurrency_group=HEALTH_CONCURRENCY_GROUP)
    def ping(self) -> bool:
        return True

    @ray.method(concurrency_group=HEALTH_CONCURRENCY_GROUP)
    def describe(self) -> dict[str, Any]:
        """Where this worker runs, for `shoal cluster status` (answered even during a step)."""
        context = ray.get_runtime_context()
        return {
            "node_id": context.get_node_id(),
            "placement_group_id": context.get_placement_group_id(),
            "gpu_ids": [str(i) for i in context.get_accelerator_ids().get("GPU", [])],
        }


def local_gpu_index() -> int:
    """The index, among the GPUs this process sees, of the GPU Ray gave this actor. Ray
    restricts CUDA_VISIBLE_DEVICES to it (index 0) unless told not to, in which case every GPU
    is visible; shoal never changes CUDA_VISIBLE_DEVICES itself."""
    assigned = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
    if not assigned:
        raise RuntimeError("this worker actor has no GPU assigned by Ray")
    visible = envs.CUDA_VISIBLE_DEVICES  # set by Ray for this actor process before it started
    if not visible:
        return int(assigned[0])
    return visible.split(",").index(str(assigned[0]))
